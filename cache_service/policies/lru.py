"""LRU: evict the block whose last use is oldest.

Cost: O(1) for every operation (an insertion-ordered dict used as a linked list: ``move_to_end``
and ``popitem(last=False)`` are O(1)). Pinned blocks leave the list and re-enter at the MRU end
when freed, which is exactly "a hit moves the block to MRU" because every pin follows a hit.
Freed blocks arrive tail-first, so the root of a request ends up most recent and LRU evicts deeper
blocks first (the cache stays ancestor-closed).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from nanokv.cache_service.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._reused: set[int] = set()  # only for snapshot(); cleared when the block is forgotten

    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        self._order[block_id] = None
        self._order.move_to_end(block_id)

    def on_hit(self, block_id: int) -> None:
        self._reused.add(block_id)
        if block_id in self._order:
            self._order.move_to_end(block_id)

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        self._order.pop(block_id, None)
        if forget:
            self._reused.discard(block_id)

    def victim(self) -> int:
        block_id, _ = self._order.popitem(last=False)
        self._reused.discard(block_id)
        return block_id

    def __len__(self) -> int:
        return len(self._order)

    def snapshot(self) -> list[tuple[int, bool]]:
        return [(b, b in self._reused) for b in self._order]
