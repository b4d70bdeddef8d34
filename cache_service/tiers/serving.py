"""The hierarchy in the serving path: the host tier (L2) of the cache service and the copies it asks for.

The cache service decides every movement in its plan, with the same TieredCache the simulator
replays (hierarchy.py). Bytes between the device pool (L1) and the host segment (L2) are moved by
the compute service, which maps both segments: the plan's reply lists the copies
(PlanReply.copies, (kind, L1 block, L2 slot)), the gateway hands them to the next step
(StepRequest.copies), and the compute service runs them in that order before the step's forward
pass. That order is the whole synchronisation:
  * a victim's write-back (COPY_SAVE) was logged when the allocation took its block, so it runs
    before the forward pass that writes the block's new owner;
  * a hit's load (COPY_LOAD) was logged after the allocation's write-backs, so it lands in its
    fresh block before the forward pass reads it, and before a later copy reuses its L2 slot;
  * steps run in order on the compute service (on a GPU, on one stream), so the copies of a plan
    sent ahead under async scheduling still follow the step before them.
The cache service never reads or writes a KV byte of L2: no RPC carries KV, and no lock is needed
between the two processes.

A loaded block is published in L1 in the plan that loads it (its bytes land before any step reads
it), and L2 drops its copy (LowerTier.keep_on_load False): L1 and L2 hold distinct blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanokv.cache_service.manager import KVCacheManager
from nanokv.cache_service.tiers.formats import TierFormat
from nanokv.cache_service.tiers.hierarchy import L1, LowerMatch, TieredCache
from nanokv.cache_service.tiers.lower_tier import LowerTier
from nanokv.cache_service.types import PrefixMatch
from nanokv.messages import COPY_LOAD, COPY_SAVE

L2 = "L2"


@dataclass
class TierCounters:
    """What /metrics shows per tier (monotonic, but occupancy and capacity)."""
    hit_tokens: dict[str, int]
    moved_blocks: dict[str, int]  # "L1->L2", "L2->L1", ...
    blocks: dict[str, int]  # resident now
    capacity_blocks: dict[str, int]


class ServingTiers:
    """L1 (the manager's device pool) above a host tier of ``slots`` blocks, as the planner uses it."""

    def __init__(self, manager: KVCacheManager, slots: int, fmt: TierFormat, policy: str = "lru"):
        self.l2 = LowerTier(L2, slots, fmt, policy)
        self.cache = TieredCache(manager, [self.l2], l1_format=fmt)
        self.cache.on_move = self._on_move
        self.block_size = manager.block_size
        self.copies: list[tuple[int, int, int]] = []

    def _on_move(self, src: int, dst: int, block_hash: bytes, loc: int, slot: int) -> None:
        if src == 0 and dst == 1:
            self.copies.append((COPY_SAVE, loc, slot))

    # ---- an admission's prefix below L1 ---------------------------------------------------------
    def begin(self, prefix: PrefixMatch) -> LowerMatch:
        """The chain past L1's hit that L2 holds, pinned until `land` or `cancel`."""
        lm = self.cache.match_lower(prefix)
        self.cache.begin_load(lm)
        return lm

    def land(self, lm: LowerMatch, table: list[int]) -> int:
        """The sequence got its blocks (`table`, L1's hit first): log a load per block into its
        fresh block. The caller publishes them in L1 (cache_blocks), then calls `finish`."""
        tiers = self.cache.tiers
        for i, (h, lvl) in enumerate(zip(lm.block_hashes[lm.start:], lm.sources)):
            slot = tiers[lvl - 1].slot(h)
            if slot is None:  # pinned: cannot have left
                raise RuntimeError(f"{tiers[lvl - 1].name}: a pinned block lost its slot")
            self.copies.append((COPY_LOAD, table[lm.start + i], slot))
        return lm.num_blocks * self.block_size

    def finish(self, lm: LowerMatch) -> None:
        self.cache.finish_load(lm)

    def cancel(self, lm: LowerMatch) -> None:
        self.cache.cancel_load(lm)

    def take_copies(self) -> list[tuple[int, int, int]]:
        out, self.copies = self.copies, []
        return out

    # ---- administration ---------------------------------------------------------------------------
    def clear(self) -> int:
        """Drop every unpinned L2 copy (reset_prefix_cache); returns how many."""
        return sum(self.l2.discard(h) for h in self.l2.keys())

    def pinned(self) -> int:
        """L2 blocks pinned by loads (0 between plans: a plan lands or cancels every load it begins)."""
        return len(self.l2) - self.l2.num_evictable

    def counters(self) -> TierCounters:
        st = self.cache.stats
        return TierCounters(dict(st.hit_tokens), dict(st.moved), self.cache.occupancy(), self.cache.capacity())

__all__ = ["L1", "L2", "ServingTiers", "TierCounters"]
