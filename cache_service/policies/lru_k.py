"""LRU-K (O'Neil, O'Neil & Weikum, SIGMOD'93): evict the largest backward K-distance.

Each block keeps the times of its last K references (a logical clock ticked per reference). Blocks
with fewer than K references have infinite K-distance and go first, least recently used first (the
paper's subsidiary LRU); among the rest the oldest K-th most recent reference loses. The reference
history of evicted blocks is retained (keyed by hash, bounded to ``capacity`` entries, FIFO), so a
block that comes back remembers it was used before - the "retained information period".

Cost: O(1) for blocks with < K references (an ordered dict), amortized O(log n) for the others (a
lazy-deletion heap keyed by the K-th reference time).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from nanokv.cache_service.policies._heap import LazyHeap
from nanokv.cache_service.policies.base import EvictionPolicy, WarmBlock


class LRUKPolicy(EvictionPolicy):
    name = "lru_k"

    def __init__(self, capacity: int, k: int = 2, history: int | None = None) -> None:
        super().__init__(capacity)
        if k < 1:
            raise ValueError("k must be >= 1")
        self.k = k
        self._history_follows_capacity = history is None
        self.history_capacity = capacity if history is None else history
        self._now = 0
        self._refs: dict[int, list[int]] = {}  # block -> last K reference times, oldest first
        self._key: dict[int, Hashable] = {}  # blocks admitted (evictable or pinned)
        self._young: OrderedDict[int, None] = OrderedDict()  # evictable, < K refs, LRU first
        self._old = LazyHeap()  # evictable, K refs, keyed by the K-th most recent time
        self._retained: OrderedDict[Hashable, list[int]] = OrderedDict()
        self._inherited: dict[Hashable, list[int]] = {}  # warm start: see inherit(), <= capacity entries

    def _ref(self, block_id: int) -> list[int]:
        self._now += 1
        refs = self._refs.setdefault(block_id, [])
        refs.append(self._now)
        if len(refs) > self.k:
            del refs[0]
        return refs

    def _place(self, block_id: int) -> None:
        refs = self._refs[block_id]
        if len(refs) < self.k:
            self._young[block_id] = None
            self._young.move_to_end(block_id)
        else:
            self._young.pop(block_id, None)
            self._old.push(block_id, refs[0])

    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        if block_id not in self._key:
            # First release after the block was computed: that computation was a reference.
            self._key[block_id] = key
            past = self._retained.pop(key, None)
            if past is None:
                past = self._inherited.pop(key, []) if self._inherited else []
            hits = self._refs.pop(block_id, [])
            self._refs[block_id] = (past + hits)[-self.k:]
            self._ref(block_id)
        self._place(block_id)

    def on_hit(self, block_id: int) -> None:
        self._ref(block_id)
        if block_id in self._young or block_id in self._old:
            self._place(block_id)

    def inherit(self, donor: EvictionPolicy | None, blocks: Sequence[WarmBlock]) -> None:
        """Warm start: the donor's clock and reference history, for blocks it evicted (retained) and
        for the ones it holds; a live block the donor holds keeps the donor's reference times."""
        if not isinstance(donor, LRUKPolicy):
            return super().inherit(donor, blocks)
        self._now = donor._now
        self._retained = OrderedDict((key, list(refs)) for key, refs in donor._retained.items())
        held = {key: list(donor._refs[b]) for b, key in donor._key.items() if b in donor._refs}
        for b, key, depth, reused in blocks:
            refs = held.pop(key, None) or self._retained.pop(key, None)
            if refs is None:  # the donor never saw it (or forgot): a cold admission
                self.on_evictable(b, key, depth)
                if reused:
                    self.on_hit(b)
                continue
            self._key[b] = key
            self._refs[b] = refs[-self.k:]
            self._place(b)
        # Blocks the donor holds and the live cache lost: in the donor they are resident, so their
        # history waits here until they are computed again, not in the FIFO a scan would flush.
        self._inherited = held
        return None

    def resize(self, capacity: int) -> None:
        super().resize(capacity)
        if self._history_follows_capacity:
            self.history_capacity = capacity

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        self._young.pop(block_id, None)
        self._old.discard(block_id)
        if forget:
            self._refs.pop(block_id, None)
            self._key.pop(block_id, None)

    def victim(self) -> int:
        if self._young:
            b, _ = self._young.popitem(last=False)
        else:
            b = self._old.pop()
        key = self._key.pop(b)
        self._retained[key] = self._refs.pop(b)
        if len(self._retained) > self.history_capacity:
            self._retained.popitem(last=False)
        return b

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def snapshot(self) -> list[tuple[int, bool]]:
        return [(b, False) for b in self._young] + [(b, True) for b in self._old.ordered()]
