"""A min-heap with lazy deletion, shared by the priority-ordered policies (LRU-K, Belady, depth_lru).

``push`` replaces any earlier entry of the same block (the old one becomes stale); ``discard``
invalidates; ``pop`` skips stale entries. The heap is rebuilt when stale entries outnumber live
ones, so every operation stays amortized O(log n) and memory O(live).
"""

from __future__ import annotations

import heapq
from typing import Any


class LazyHeap:
    def __init__(self) -> None:
        self._heap: list[tuple[Any, int, int]] = []  # (priority, stamp, block)
        self._live: dict[int, tuple[Any, int]] = {}  # block -> (priority, stamp)
        self._stamp = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._live

    def push(self, block_id: int, priority: Any) -> None:
        self._stamp += 1
        self._live[block_id] = (priority, self._stamp)
        heapq.heappush(self._heap, (priority, self._stamp, block_id))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(p, s, b) for b, (p, s) in self._live.items()]
            heapq.heapify(self._heap)

    def discard(self, block_id: int) -> None:
        self._live.pop(block_id, None)

    def pop(self) -> int:
        """Remove and return the block with the smallest priority (ties: oldest push)."""
        heap, live = self._heap, self._live
        while True:
            _, stamp, b = heapq.heappop(heap)
            cur = live.get(b)
            if cur is not None and cur[1] == stamp:
                del live[b]
                return b

    def ordered(self) -> list[int]:
        """Live blocks, smallest priority first (O(n log n); snapshots only)."""
        return [b for b, _ in sorted(self._live.items(), key=lambda kv: (kv[1][0], kv[1][1]))]
