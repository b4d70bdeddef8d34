"""Simulator-only policies for ``nanokv_tools.sim.headroom``: two oracles of dead blocks and two online
probes that try to predict a conversation's end (docs/cache-policies.md, "The headroom"). They are
not in the registry: the oracles need future knowledge, and the probes lose to leaf_lru.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable

from nanokv.cache_service.policies.base import EvictionPolicy
from nanokv.cache_service.policies.leaf_lru import LeafLRUPolicy

NextUse = Callable[[Hashable], float]  # index of the next request using a key, inf if none


class DeadOracle(EvictionPolicy):
    """LRU; a block the oracle says is never requested again goes to a cold FIFO evicted first
    (``leaves_only``: only a sequence's last block, ``tail == 0``)."""

    name = "dead_oracle"

    def __init__(self, capacity: int, next_use: NextUse, leaves_only: bool) -> None:
        super().__init__(capacity)
        self._next_use, self.leaves_only = next_use, leaves_only
        self._cold: OrderedDict[int, None] = OrderedDict()
        self._lru: OrderedDict[int, None] = OrderedDict()

    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        if self._next_use(key) == float("inf") and (tail == 0 or not self.leaves_only):
            self._cold[block_id] = None
        else:
            self._lru[block_id] = None
            self._lru.move_to_end(block_id)

    def on_hit(self, block_id: int) -> None:
        if block_id in self._lru:
            self._lru.move_to_end(block_id)

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        self._cold.pop(block_id, None)
        self._lru.pop(block_id, None)

    def victim(self) -> int:
        return (self._cold if self._cold else self._lru).popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._cold) + len(self._lru)

    def snapshot(self) -> list[tuple[int, bool]]:
        return [(b, False) for q in (self._cold, self._lru) for b in q]


class ReusedAgesSlower(LeafLRUPolicy):
    """leaf_lru with its reused blocks in a second LRU list: the victim is the head of the list whose
    head is older, the reused list's age counted ``1 / w`` (O(1): two heads compared)."""

    name = "probe_reused"

    def __init__(self, capacity: int, w: float = 2.0) -> None:
        super().__init__(capacity)
        self.w = w
        self._hot: OrderedDict[int, int] = OrderedDict()  # block -> release time, oldest first
        self._released: dict[int, int] = {}  # evictable block -> its release time

    def _promote(self, block_id: int) -> None:
        if block_id in self._reused and block_id in self._lru:
            del self._lru[block_id]
            self._hot[block_id] = self._released[block_id]
        if block_id in self._hot:
            self._hot.move_to_end(block_id)

    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        super().on_evictable(block_id, key, depth, tail)
        self._released[block_id] = self._now
        self._promote(block_id)

    def on_hit(self, block_id: int) -> None:
        super().on_hit(block_id)
        if block_id in self._released:
            self._promote(block_id)

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        super().on_remove(block_id, forget)
        self._hot.pop(block_id, None)
        self._released.pop(block_id, None)

    def victim(self) -> int:
        if not self._cold and self._hot:
            hot_age = self._now - next(iter(self._hot.values()))
            if not self._lru or (self._now - self._released[next(iter(self._lru))]) * self.w < hot_age:
                block_id, _ = self._hot.popitem(last=False)
                del self._key[block_id]
                self._reused.discard(block_id)
                self._released.pop(block_id, None)
                return block_id
        block_id = super().victim()
        self._released.pop(block_id, None)
        return block_id

    def __len__(self) -> int:
        return super().__len__() + len(self._hot)

    def snapshot(self) -> list[tuple[int, bool]]:
        return super().snapshot() + [(b, True) for b in self._hot]


class IdleGapEnd(LeafLRUPolicy):
    """leaf_lru; a block released again after a hit is predicted to have ended once it is idle for
    ``k`` times the gap between its last two releases, and goes before the LRU list (a lazy heap of
    predicted end times, O(log n))."""

    name = "probe_idle_gap"

    def __init__(self, capacity: int, k: float = 8.0) -> None:
        super().__init__(capacity)
        self.k = k
        self._released: dict[int, int] = {}  # block -> last release time, while it has a key
        self._ends: list[tuple[float, int, int]] = []  # (predicted end, block, version)
        self._version: dict[int, int] = {}

    def _bump(self, block_id: int) -> None:
        self._version[block_id] = self._version.get(block_id, 0) + 1

    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        before = self._released.get(block_id)
        super().on_evictable(block_id, key, depth, tail)
        self._released[block_id] = self._now
        if before is not None and block_id in self._lru:
            self._bump(block_id)
            heapq.heappush(self._ends, (self._now + self.k * (self._now - before), block_id,
                                        self._version[block_id]))

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        super().on_remove(block_id, forget)
        self._bump(block_id)
        if forget:
            self._released.pop(block_id, None)

    def victim(self) -> int:
        ends = self._ends
        while ends and (ends[0][2] != self._version.get(ends[0][1]) or ends[0][1] not in self._lru):
            heapq.heappop(ends)
        if not self._cold and ends and ends[0][0] < self._now:
            _, block_id, _ = heapq.heappop(ends)
            del self._lru[block_id]
            del self._key[block_id]
            self._reused.discard(block_id)
        else:
            block_id = super().victim()
        self._bump(block_id)
        self._released.pop(block_id, None)
        return block_id


class EvictionAges(LeafLRUPolicy):
    """leaf_lru that records how long each block it evicts from the LRU list had been idle (releases)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.ages: list[int] = []
        self._released: dict[int, int] = {}

    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        super().on_evictable(block_id, key, depth, tail)
        self._released[block_id] = self._now

    def victim(self) -> int:
        from_lru = not self._cold
        block_id = super().victim()
        released = self._released.pop(block_id)
        if from_lru:
            self.ages.append(self._now - released)
        return block_id
