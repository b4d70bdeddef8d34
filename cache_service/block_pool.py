"""Physical KV blocks: refcounts, the hash -> block index, the free list and the evictable set.

Every block is in exactly one of three states:
  * in use     - refcount > 0 (it may also hold a cached hash and be shared),
  * evictable  - refcount 0 and holding a cached hash; owned by the eviction policy,
  * free       - refcount 0, no hash; on the free list.
Allocation takes free blocks first (they hold nothing worth keeping) and only then asks the policy
for a victim. All operations are O(1) plus the policy's cost, except ``grow``/``shrink`` (the
adaptive pool rule, rare): O(blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from nanokv.cache_service.policies.base import EvictionPolicy, WarmBlock


class BlockPool:
    def __init__(self, num_blocks: int, policy: EvictionPolicy) -> None:
        self.num_blocks = num_blocks
        self.policy = policy
        self.ref = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        self.depth = [0] * num_blocks  # logical block index of the cached content (for policies)
        self.index: dict[bytes, int] = {}
        # A stack: pop() hands out 0, 1, 2, ... first, which keeps small pools easy to read in tests.
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.num_evictable = 0
        self.num_used = 0
        self.evictions = 0  # monotonic; the manager turns it into per-policy stats
        # Bounded memory of evicted hashes: lets the manager count tokens recomputed because of
        # eviction. FIFO-bounded at 2 x num_blocks entries (O(1) insert/trim).
        self.recently_evicted: OrderedDict[bytes, None] = OrderedDict()
        # on_evict(block, hash, depth): a cached block loses its hash to make room (policy victim or
        # shrink), called while block ``block`` still holds the content - the memory hierarchy
        # (cache_service/tiers) writes it to a lower tier. None: no hierarchy, no cost.
        self.on_evict: Callable[[int, bytes, int], None] | None = None
        # on_removed(hash): a cached hash left the index (evicted, shrunk away or dropped); the KV-event
        # log (cache_service/kv_events.py) publishes it. Separate from on_evict: it hears every removal.
        self.on_removed: Callable[[bytes], None] | None = None

    # ---- queries ------------------------------------------------------------------------------
    def num_allocatable(self) -> int:
        return len(self.free) + self.num_evictable

    def lookup(self, block_hash: bytes) -> int | None:
        return self.index.get(block_hash)

    # ---- state changes -----------------------------------------------------------------------
    def take(self, n: int) -> list[int]:
        """Hand out ``n`` blocks with refcount 1. Caller must check ``num_allocatable() >= n``."""
        out: list[int] = []
        free, ref = self.free, self.ref
        for _ in range(n):
            b = free.pop() if free else self._evict_one()
            ref[b] = 1
            out.append(b)
        self.num_used += n
        return out

    def pin(self, b: int) -> None:
        """Add a reference to a cached block (prefix hit). The policy hears about the hit first."""
        self.policy.on_hit(b)
        if self.ref[b] == 0:
            self.policy.on_remove(b)
            self.num_evictable -= 1
            self.num_used += 1
        self.ref[b] += 1

    def touch(self, b: int) -> None:
        """The content of cached block ``b`` was requested without pinning it."""
        self.policy.on_hit(b)

    def release(self, b: int, tail: int = -1) -> None:
        ref = self.ref[b] - 1
        if ref < 0:
            raise RuntimeError(f"block {b} released more often than referenced")
        self.ref[b] = ref
        if ref:
            return
        self.num_used -= 1
        h = self.hash[b]
        if h is None:
            self.free.append(b)
        else:
            self.num_evictable += 1
            self.policy.on_evictable(b, h, self.depth[b], tail)

    def register(self, b: int, block_hash: bytes, depth: int) -> bool:
        """Give in-use block ``b`` a cached hash. False if the hash is already cached elsewhere."""
        if block_hash in self.index:
            return False
        self.index[block_hash] = b
        self.hash[b] = block_hash
        self.depth[b] = depth
        self.recently_evicted.pop(block_hash, None)
        return True

    def _evict_one(self) -> int:
        b = self.policy.victim()
        h = self.hash[b]
        if h is None or self.ref[b] != 0:
            raise RuntimeError(f"policy {self.policy.name} chose block {b} which is not evictable")
        del self.index[h]
        self.hash[b] = None
        self.num_evictable -= 1
        self.evictions += 1
        recent = self.recently_evicted
        recent[h] = None
        if len(recent) > 2 * self.num_blocks:
            recent.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(b, h, self.depth[b])
        if self.on_removed is not None:
            self.on_removed(h)
        return b

    def drop_evictable(self) -> None:
        """Forget every evictable cached block (they go to the free list)."""
        for h, b in list(self.index.items()):
            if self.ref[b] == 0:
                self.policy.on_remove(b, forget=True)
                del self.index[h]
                self.hash[b] = None
                self.free.append(b)
                if self.on_removed is not None:
                    self.on_removed(h)
        self.num_evictable = 0
        self.recently_evicted.clear()

    def replace_policy(self, new: EvictionPolicy, donor: BlockPool | None = None) -> None:
        """Hand every evictable block to ``new`` (``EvictionPolicy.inherit``) coldest first.

        Without a donor the order and "was reused" bits are the current policy's. With ``donor``
        (a pool run by a policy of ``new``'s class on the same stream: the adaptive controller's
        ghost), the blocks the donor also holds follow the donor's order and bits, matched by hash,
        after the ones it does not hold (those it evicted: coldest), and ``new`` copies the donor's
        key-indexed history."""
        blocks: list[WarmBlock] = []
        for b, reused in self.policy.snapshot():
            h = self.hash[b]
            assert h is not None  # internal invariant: evictable blocks hold a hash
            blocks.append((b, h, self.depth[b], reused))
        donor_policy = None
        if donor is not None:
            if type(donor.policy) is not type(new):
                raise ValueError(f"donor runs {donor.policy.name}, not {new.name}")
            donor_policy = donor.policy
            rank: dict[Hashable, tuple[int, bool]] = {}
            for i, (b, reused) in enumerate(donor_policy.snapshot()):
                h = donor.hash[b]
                if h is not None:
                    rank[h] = (i, reused)
            blocks = ([w for w in blocks if w[1] not in rank]
                      + sorted(((b, h, d, rank[h][1]) for b, h, d, _ in blocks if h in rank),
                               key=lambda w: rank[w[1]][0]))
        new.inherit(donor_policy, blocks)
        self.policy = new

    # ---- resizing (nanokv.gateway.adaptive pool rule) -------------------------------------------------------
    def grow(self, num_blocks: int) -> None:
        """Append block ids [N, num_blocks) as free blocks. They go to the bottom of the free stack:
        the old free blocks are handed out first, so the new ids (the first to go on a shrink) fill
        last."""
        old = self.num_blocks
        if num_blocks <= old:
            return
        n = num_blocks - old
        self.ref.extend([0] * n)
        self.hash.extend([None] * n)
        self.depth.extend([0] * n)
        self.free[:0] = range(num_blocks - 1, old - 1, -1)  # pop() takes old, then N, N+1, ...
        self.num_blocks = num_blocks
        self.policy.resize(num_blocks)

    def shrink_floor(self) -> int:
        """The smallest pool that keeps every referenced block: highest referenced id + 1 (>= 1)."""
        ref = self.ref
        for b in range(self.num_blocks - 1, -1, -1):
            if ref[b]:
                return b + 1
        return 1

    def shrink(self, num_blocks: int) -> int:
        """Remove the highest block ids down to ``num_blocks``, or only as far as the highest
        referenced block allows (a referenced block is never touched: block tables keep their ids).
        Cached-but-unreferenced blocks among the removed ids are evicted like a policy victim
        (index, evictions counter, recently-evicted memory). Returns the new block count."""
        new = max(num_blocks, self.shrink_floor())
        old = self.num_blocks
        if new >= old:
            return old
        recent = self.recently_evicted
        for b in range(new, old):
            h = self.hash[b]
            self.policy.on_remove(b, forget=True)  # evictable or free: no trace of the id may stay
            if h is not None:
                del self.index[h]
                self.num_evictable -= 1
                self.evictions += 1
                recent[h] = None
                if self.on_evict is not None:
                    self.on_evict(b, h, self.depth[b])
                if self.on_removed is not None:
                    self.on_removed(h)
        self.free = [b for b in self.free if b < new]
        del self.ref[new:], self.hash[new:], self.depth[new:]
        self.num_blocks = new
        while len(recent) > 2 * new:
            recent.popitem(last=False)
        self.policy.resize(new)
        return new
