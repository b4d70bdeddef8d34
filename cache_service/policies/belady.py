"""Belady's MIN, offline: evict the block whose next use is furthest in the future.

Needs an oracle ``next_use(key) -> float`` (index of the next request using the key, inf if none),
so it exists for the simulator only. Ties go to the deeper block (a deeper block is useless once its
ancestors are gone). Eviction is lazy - a block is only evicted when space is needed - which is the
manager's form of "bypass": a block never used again costs nothing while the pool has room and is
the first victim once it does not.

Cost: amortized O(log n) per operation (lazy-deletion heap keyed by (-next use, -depth)).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from nanokv.cache_service.policies._heap import LazyHeap
from nanokv.cache_service.policies.base import EvictionPolicy
from nanokv.errors import NanoKVError


class BeladyPolicy(EvictionPolicy):
    name = "belady"

    def __init__(self, capacity: int, oracle: Callable[[Hashable], float] | None = None) -> None:
        super().__init__(capacity)
        if oracle is None:
            raise NanoKVError("eviction_policy", "belady needs future knowledge (oracle=); simulator only")
        self._oracle = oracle
        self._heap = LazyHeap()
        self._key: dict[int, tuple[Hashable, int]] = {}
        self._reused: set[int] = set()

    def _push(self, block_id: int) -> None:
        key, depth = self._key[block_id]
        self._heap.push(block_id, (-self._oracle(key), -depth))

    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        self._key[block_id] = (key, depth)
        self._push(block_id)

    def on_hit(self, block_id: int) -> None:
        self._reused.add(block_id)
        if block_id in self._heap:
            self._push(block_id)  # its next use moved on

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        self._heap.discard(block_id)
        if forget:
            self._key.pop(block_id, None)
            self._reused.discard(block_id)

    def victim(self) -> int:
        b = self._heap.pop()
        del self._key[b]
        self._reused.discard(b)
        return b

    def __len__(self) -> int:
        return len(self._heap)

    def snapshot(self) -> list[tuple[int, bool]]:
        return [(b, b in self._reused) for b in self._heap.ordered()]
