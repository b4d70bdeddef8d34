"""S3-FIFO (Yang et al., SOSP'23): small FIFO S (10%), main FIFO M, ghost FIFO G of keys.

New blocks enter S, or M directly if their key is in G. A hit bumps a 2-bit counter (max 3) and
moves nothing. Eviction: while |S| >= 10% of the cache (or M is empty) pop S's head - reused
(counter >= 1) blocks move to M with counter 0, one-hit wonders are evicted and remembered in G;
otherwise pop M's head - a non-zero counter is decremented and the block reinserted, zero evicts.
G holds at most c - s keys (oldest dropped first).

Cost: O(1) per insert/hit/remove; ``victim()`` amortized O(1) since every move or reinsertion is
paid for by a hit. A pinned block is treated like any other until it would be evicted; then it is
parked outside the queues and re-enters M's tail when freed (it was in use, hence reused).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from nanokv.cache_service.policies.base import EvictionPolicy, WarmBlock


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(self, capacity: int, small_fraction: float = 0.1) -> None:
        super().__init__(capacity)
        self.small_fraction = small_fraction
        self.small_target = max(1, round(small_fraction * capacity))
        self.ghost_capacity = max(1, capacity - self.small_target)
        self._s: OrderedDict[int, None] = OrderedDict()
        self._m: OrderedDict[int, None] = OrderedDict()
        self._g: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[int, int] = {}  # every block the policy knows
        self._key: dict[int, Hashable] = {}
        self._pinned: set[int] = set()  # pinned and still queued
        self._parked: set[int] = set()  # pinned and pulled out of the queues by eviction

    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        if block_id in self._s or block_id in self._m:
            self._pinned.discard(block_id)
            return
        if block_id in self._parked:
            self._parked.discard(block_id)
            self._m[block_id] = None
            return
        self._key[block_id] = key
        self._freq.setdefault(block_id, 0)  # hits while pinned before first release still count
        if key in self._g:
            del self._g[key]
            self._m[block_id] = None
        else:
            self._s[block_id] = None

    def on_hit(self, block_id: int) -> None:
        self._freq[block_id] = min(3, self._freq.get(block_id, 0) + 1)

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        if forget:
            self._s.pop(block_id, None)
            self._m.pop(block_id, None)
            self._pinned.discard(block_id)
            self._parked.discard(block_id)
            self._freq.pop(block_id, None)
            self._key.pop(block_id, None)
        elif block_id in self._s or block_id in self._m:
            self._pinned.add(block_id)

    def inherit(self, donor: EvictionPolicy | None, blocks: Sequence[WarmBlock]) -> None:
        """Warm start: the donor's ghost queue; a live block the donor holds goes to the donor's
        queue for it (small or main) with its hit count."""
        if not isinstance(donor, S3FIFOPolicy):
            return super().inherit(donor, blocks)
        self._g = OrderedDict(donor._g)
        where = {donor._key[b]: (b in donor._m, donor._freq.get(b, 0)) for b in (*donor._s, *donor._m)
                 if b in donor._key and b not in donor._pinned}
        live = {key for _, key, _, _ in blocks}
        # Blocks the donor holds and the live cache lost join the ghost queue: recomputed, they are
        # admitted to the main queue, where the donor has them.
        self._g.update((k, None) for k in where if k not in live)
        while len(self._g) > self.ghost_capacity:
            self._g.popitem(last=False)
        for b, key, depth, reused in blocks:
            got = where.get(key)
            if got is None:
                self.on_evictable(b, key, depth)
                if reused:
                    self.on_hit(b)
                continue
            self._g.pop(key, None)
            self._key[b] = key
            self._freq[b] = got[1]
            (self._m if got[0] else self._s)[b] = None
        return None

    def resize(self, capacity: int) -> None:
        super().resize(capacity)
        self.small_target = max(1, round(self.small_fraction * capacity))
        self.ghost_capacity = max(1, capacity - self.small_target)

    def _park_if_pinned(self, b: int) -> bool:
        if b in self._pinned:
            self._pinned.discard(b)
            self._parked.add(b)
            return True
        return False

    def victim(self) -> int:
        s, m, freq = self._s, self._m, self._freq
        while True:
            if s and (len(s) >= self.small_target or not m):
                b, _ = s.popitem(last=False)
                if freq[b] >= 1:
                    freq[b] = 0
                    m[b] = None  # promoted: reused while in the probation queue
                    continue
                if self._park_if_pinned(b):
                    continue
                key = self._key.pop(b)
                del freq[b]
                self._g[key] = None
                if len(self._g) > self.ghost_capacity:
                    self._g.popitem(last=False)
                return b
            b, _ = m.popitem(last=False)
            if freq[b] > 0:
                freq[b] -= 1
                m[b] = None
                continue
            if self._park_if_pinned(b):
                continue
            del freq[b]
            del self._key[b]
            return b

    def __len__(self) -> int:
        return len(self._s) + len(self._m) - len(self._pinned)

    def snapshot(self) -> list[tuple[int, bool]]:
        return [(b, self._freq.get(b, 0) > 0) for q in (self._s, self._m) for b in q if b not in self._pinned]
