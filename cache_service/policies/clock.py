"""CLOCK (second chance): a FIFO ring with one reference bit per block.

Cost: O(1) per hit/insert/remove (a hit only sets a bit: no reordering, no lock needed in a
concurrent engine); ``victim()`` is amortized O(1) because every bit the hand clears was paid for
by an earlier hit, and every pinned block it skips is parked once per pin.

Pinned blocks stay in place (a FIFO-like policy must not reorder on use). The hand treats a pinned
block like any other (a set bit earns a second chance); only where it would evict a pinned block
does it park it outside the ring; when unpinned it re-enters at the tail with its bit set. Every
pin follows a hit, so a pinned block costs the hand at most two steps per pin.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from nanokv.cache_service.policies.base import EvictionPolicy


class ClockPolicy(EvictionPolicy):
    name = "clock"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._ring: OrderedDict[int, bool] = OrderedDict()  # head = where the hand points
        self._ref: dict[int, bool] = {}  # pending bit of blocks not in the ring (pinned/parked/new)
        self._pinned: set[int] = set()  # pinned blocks still sitting in the ring
        self._reused: set[int] = set()

    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        if block_id in self._ring:
            self._pinned.discard(block_id)  # unpinned in place: keeps its position
            return
        # New block (bit 0 unless it was hit while pinned) or a parked one coming back.
        self._ring[block_id] = self._ref.pop(block_id, False)

    def on_hit(self, block_id: int) -> None:
        self._reused.add(block_id)
        if block_id in self._ring:
            self._ring[block_id] = True
        else:
            self._ref[block_id] = True

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        if forget:
            self._ring.pop(block_id, None)
            self._pinned.discard(block_id)
            self._ref.pop(block_id, None)
            self._reused.discard(block_id)
        elif block_id in self._ring:
            self._pinned.add(block_id)

    def victim(self) -> int:
        ring = self._ring
        while True:
            block_id, bit = ring.popitem(last=False)
            if bit:
                ring[block_id] = False  # second chance: back to the tail, bit cleared
                continue
            if block_id in self._pinned:
                self._pinned.discard(block_id)
                self._ref[block_id] = True  # parked: in use counts as referenced
                continue
            self._reused.discard(block_id)
            return block_id

    def __len__(self) -> int:
        return len(self._ring) - len(self._pinned)

    def snapshot(self) -> list[tuple[int, bool]]:
        return [(b, b in self._reused) for b in self._ring if b not in self._pinned]
