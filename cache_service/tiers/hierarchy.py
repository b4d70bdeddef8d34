"""The KV cache's memory hierarchy: L1 (the device pool, KVCacheManager) above lower tiers.

    m = cm.match_prefix(ids, salt)     # L1: the leading run of device-resident blocks
    lm = tc.match_lower(m)             # the chain goes on through L2, L3: which tier holds each next block
    tc.begin_load(lm)                  # pins those copies (the engine copies them into L1)
    table = cm.allocate(seq, n, m)     # fresh L1 blocks; L1 victims flow down through the evict hook
    cm.cache_blocks(seq, ids, n)       # the loaded blocks are published in L1
    tc.finish_load(lm)                 # unpins; counts the hits and moves of the loads that landed

Ownership: a block may be held by several tiers; its *owner* is the highest tier holding it, and
every lower copy is a clean replica. KV blocks are immutable (the chained hash names the content),
so a replica never goes stale and dropping one never loses anything while its owner holds the
block. The owner is the one that must move the block down when it evicts it:
  * an L1 victim that L2 already holds needs no copy: ownership passes to L2 (``handed_down``);
    one that L2 lacks is written to L2 (``moved L1->L2``) before its device block is reused,
  * an L2 victim goes the same way to L3; an L3 victim is dropped,
  * a victim whose owner is above it (a replica) is dropped without loss (``replica_dropped``).
What happens to the source copy when a block is loaded into L1 is each tier's choice
(``LowerTier.keep_on_load``):
  * dropped (the default, and L2's in the simulator): L1 becomes the block's only holder, so L1 and
    L2 together hold L1 + L2 distinct blocks; a later L1 eviction writes the block back again;
  * kept as a replica (L3's in the simulator): a conversation that loads its prefix from disk on
    every turn and evicts it again does not rewrite it; the copy costs capacity, which the disk has
    plenty of, and saves writes, which the disk has few of (wear, bandwidth).
A block recomputed in L1 while an orphaned copy of it sits below (its parent was lost) simply makes
that copy a replica: nothing needs to watch every publication. Strict exclusion would need that.

Each tier has its own eviction policy (LowerTier). Every operation costs O(blocks touched x tiers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nanokv.cache_service.manager import KVCacheManager
from nanokv.cache_service.tiers.formats import TierFormat
from nanokv.cache_service.tiers.lower_tier import LowerTier
from nanokv.cache_service.types import PrefixMatch
from nanokv.errors import NanoKVError

L1 = "L1"


@dataclass
class LowerMatch:
    """The chain past L1's hit: ``sources[i]`` is the level (1 = the first lower tier) that holds
    block ``start + i``, the highest one holding it (the fastest to load from), or 0 where L1 itself
    still holds it: L1 evicted an earlier block of the chain and kept this one (a policy that is not
    leaf-first does, clock for one), and the run from below reaches it again. Such a block is reused
    in place (``resident``), not loaded."""

    block_hashes: list[bytes]
    start: int  # blocks L1 holds (the PrefixMatch's hit)
    sources: list[int]
    l1_blocks: dict[int, int] = field(default_factory=dict)  # chain position -> L1 block, for sources 0

    @property
    def num_blocks(self) -> int:
        return len(self.sources)

    def resident(self) -> dict[int, int]:
        """{position: L1 block} of the chain's blocks L1 holds past its leading run (the chain may
        have been cut short since the match: only those still in it)."""
        end = self.start + len(self.sources)
        return {i: b for i, b in self.l1_blocks.items() if i < end}

    def per_level(self, num_levels: int) -> list[int]:
        """Blocks per level: [L1 hits, from the first lower tier, ...]."""
        out = [self.start] + [0] * (num_levels - 1)
        for lvl in self.sources:
            out[lvl] += 1
        return out


@dataclass
class HierarchyStats:
    """Monotonic counters, keyed by level name ("L1", "L2", ...) or move ("L1->L2", "L2->L1")."""

    hit_blocks: dict[str, int] = field(default_factory=dict)
    hit_tokens: dict[str, int] = field(default_factory=dict)
    moved: dict[str, int] = field(default_factory=dict)  # copies made: down (write-back) or up (loads)
    handed_down: dict[str, int] = field(default_factory=dict)  # victim already held below: no copy
    evictions: dict[str, int] = field(default_factory=dict)  # victims per level
    replica_dropped: dict[str, int] = field(default_factory=dict)  # victims whose owner is above
    dropped: dict[str, int] = field(default_factory=dict)  # victims lost to the whole hierarchy

    def add(self, table: dict[str, int], key: str, n: int = 1) -> None:
        table[key] = table.get(key, 0) + n


class TieredCache:
    def __init__(self, manager: KVCacheManager, tiers: Sequence[LowerTier], *,
                 l1_format: TierFormat | None = None) -> None:
        names = [L1] + [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise NanoKVError("tiers", f"tier names must be distinct and not {L1!r}; got {names}")
        self.manager = manager
        self.tiers = list(tiers)
        self.names = names
        self.l1_format = l1_format
        self.stats = HierarchyStats()
        # on_move(src level, dst level, hash, src location, dst slot): a copy down the hierarchy the
        # engine must make (L1 location: the device block; lower: the tier's slot). Called after the
        # victim the copy displaces was moved on, so a caller that logs copies logs them in the order
        # they must run (the victim's bytes leave a slot before the new block's bytes land in it).
        self.on_move: Callable[[int, int, bytes, int, int], None] | None = None
        # on_leave(level, hash): a lower tier's copy is gone for good (its victim dropped, or a
        # replica evicted): a tier that keeps bytes elsewhere (the disk's files) frees them
        self.on_leave: Callable[[int, bytes, int], None] | None = None  # (level, hash, its location there)
        for n in names:
            for table in (self.stats.hit_blocks, self.stats.hit_tokens, self.stats.evictions,
                          self.stats.replica_dropped, self.stats.dropped):
                table[n] = 0
        manager.set_evict_hook(self._on_l1_evict if self.tiers else None)

    # ---- lookups ------------------------------------------------------------------------------
    def match_lower(self, prefix: PrefixMatch) -> LowerMatch:
        """Continue ``prefix`` (L1's hit) through the lower tiers, block by block, as far as some
        lower tier holds the next block; keeps match_prefix's cap (one token left to compute).
        Read-only, O(blocks matched x tiers)."""
        hashes = prefix.block_hashes
        start = len(prefix.block_ids)
        n_q = prefix.num_query_tokens
        cap = min(len(hashes), (n_q - 1) // self.manager.block_size if n_q else 0)
        sources: list[int] = []
        l1: dict[int, int] = {}
        tiers = self.tiers
        index = self.manager.pool.index
        for i in range(start, cap):
            h = hashes[i]
            b = index.get(h)
            if b is not None:  # past a block L1 lost: reused in place
                sources.append(0)
                l1[i] = b
                continue
            for lvl, t in enumerate(tiers, 1):
                if h in t:
                    sources.append(lvl)
                    break
            else:
                break
        return LowerMatch(list(hashes), start, sources, l1)

    def owner(self, block_hash: bytes) -> str | None:
        """The level that owns the block (the highest holding it), or None."""
        if block_hash in self.manager.pool.index:
            return L1
        for t in self.tiers:
            if block_hash in t:
                return t.name
        return None

    def occupancy(self) -> dict[str, int]:
        """Blocks resident per level (L1: cached blocks, in use or evictable)."""
        return {L1: len(self.manager.pool.index), **{t.name: len(t) for t in self.tiers}}

    def capacity(self) -> dict[str, int]:
        return {L1: self.manager.num_blocks, **{t.name: t.capacity for t in self.tiers}}

    def capacity_bytes(self) -> dict[str, int] | None:
        """Bytes per level, or None without an L1 format."""
        if self.l1_format is None:
            return None
        return {L1: self.manager.num_blocks * self.l1_format.bytes_per_block,
                **{t.name: t.capacity_bytes() for t in self.tiers}}

    # ---- loads (a prefix hit below L1) --------------------------------------------------------
    def begin_load(self, lm: LowerMatch) -> None:
        """Pin the copies a request will load, so no eviction (its own allocation's included)
        takes them before they land in L1."""
        tiers = self.tiers
        for h, lvl in zip(lm.block_hashes[lm.start:], lm.sources):
            if lvl:
                tiers[lvl - 1].pin(h)

    def finish_load(self, lm: LowerMatch) -> int:
        """Unpin the copies; count L1's hits and each load that landed (its hash is now in L1: the
        caller allocated and published it). A tier without keep_on_load drops a landed block's copy.
        A load that did not land leaves its copy the owner. Returns the blocks loaded."""
        st, names, bs = self.stats, self.names, self.manager.block_size
        st.add(st.hit_blocks, L1, lm.start)
        st.add(st.hit_tokens, L1, lm.start * bs)
        index = self.manager.pool.index
        loaded = 0
        for h, lvl in zip(lm.block_hashes[lm.start:], lm.sources):
            if not lvl:  # reused in place: an L1 hit
                if h in index:
                    st.add(st.hit_blocks, L1)
                    st.add(st.hit_tokens, L1, bs)
                continue
            t = self.tiers[lvl - 1]
            t.unpin(h)
            if h not in index:
                continue
            loaded += 1
            name = names[lvl]
            st.add(st.hit_blocks, name)
            st.add(st.hit_tokens, name, bs)
            st.add(st.moved, f"{name}->{L1}")
            if not t.keep_on_load:
                t.discard(h)
        return loaded

    def cancel_load(self, lm: LowerMatch) -> None:
        """The request was not admitted: unpin, count nothing."""
        for h, lvl in zip(lm.block_hashes[lm.start:], lm.sources):
            if lvl:
                self.tiers[lvl - 1].unpin(h)

    # ---- movement down ------------------------------------------------------------------------
    def _on_l1_evict(self, block: int, block_hash: bytes, depth: int) -> None:
        self._demote(0, block_hash, depth, block)

    def _held_above(self, block_hash: bytes, level: int) -> bool:
        if level == 0:
            return False
        if block_hash in self.manager.pool.index:
            return True
        return any(block_hash in t for t in self.tiers[: level - 1])

    def _demote(self, level: int, block_hash: bytes, depth: int, loc: int = -1) -> None:
        """Level ``level`` evicted the block (its bytes at ``loc`` there): hand it down, write it
        down, or drop it."""
        st, names = self.stats, self.names
        src = names[level]
        st.add(st.evictions, src)
        if self._held_above(block_hash, level):
            st.add(st.replica_dropped, src)
            if level and self.on_leave is not None:
                self.on_leave(level, block_hash, loc)
            return
        for dst in range(level + 1, len(names)):
            t = self.tiers[dst - 1]
            if block_hash in t:
                t.touch(block_hash)
                st.add(st.handed_down, f"{src}->{names[dst]}")
                return
            admitted, victim = t.admit(block_hash, depth)
            if admitted:  # refused only when every slot is pinned: try the tier below
                st.add(st.moved, f"{src}->{names[dst]}")
                slot = t.slot(block_hash)
                slot = -1 if slot is None else slot
                if victim is not None:  # its bytes sit in the slot the new block takes
                    self._demote(dst, *victim, slot)
                if self.on_move is not None:
                    self.on_move(level, dst, block_hash, loc, slot)
                return
        st.add(st.dropped, src)
        if level and self.on_leave is not None:
            self.on_leave(level, block_hash, loc)
