"""The INT4 demotion store's free list, kept by the cache service (hybrid sparsity).

The store's tensors live with the KV layers in the compute service (nanokv.kv.demote); which slot
holds what is decided here, with the blocks: a slot is taken when a block is demoted and comes
back when the KVCacheManager releases the entry naming it (a drop, the sequence's end, abort or
preemption: KVCacheManager.set_external_release). Pure Python.
"""

from __future__ import annotations

from nanokv.errors import NanoKVError
from nanokv.sparsity import code_slot


class DemotionSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() hands out 0, 1, 2, ... first
        self._held = [False] * num_slots

    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """Up to n free slots (fewer when the store runs out)."""
        out = [self._free.pop() for _ in range(min(n, len(self._free)))]
        for j in out:
            self._held[j] = True
        return out

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or not self._held[slot]:
            raise NanoKVError("slot", f"demotion-store slot {slot} is not held (released twice?)")
        self._held[slot] = False
        self._free.append(slot)

    def release_code(self, entry: int) -> None:
        """The KVCacheManager's external release: the slot of a block-table entry (<= -2) is free."""
        self.release(code_slot(entry))
