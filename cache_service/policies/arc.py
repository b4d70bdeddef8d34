"""ARC (Megiddo & Modha, FAST'03): recency list T1, frequency list T2, ghosts B1/B2, adaptive p.

T1 holds blocks seen once, T2 blocks hit again; B1/B2 remember keys recently evicted from each. A
new block whose key is in B1 means "T1 was too small": p grows by max(|B2|/|B1|, 1); a B2 ghost
shrinks p by max(|B1|/|B2|, 1). The victim comes from T1 while |T1| > p, else from T2. Ghosts are
trimmed so that |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c (bounded history).

Only evictable blocks live in T1/T2: a pinned block leaves its list and, when freed, re-enters at
the MRU end of T2 if it was hit meanwhile (it always is: pins follow hits), else of its old list.
Cost: O(1) per operation (ordered dicts as linked lists).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from nanokv.cache_service.policies.base import EvictionPolicy, WarmBlock


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._key: dict[int, Hashable] = {}  # blocks admitted (evictable or pinned)
        self._freq: dict[int, bool] = {}  # True: belongs to T2 (seen at least twice)

    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        if block_id not in self._key:
            self._admit(block_id, key)
        (self._t2 if self._freq.get(block_id) else self._t1)[block_id] = None

    def _admit(self, block_id: int, key: Hashable) -> None:
        self._key[block_id] = key
        c = self.capacity
        if key in self._b1:
            self.p = min(float(c), self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._freq[block_id] = True
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._freq[block_id] = True
        self._trim()

    def on_hit(self, block_id: int) -> None:
        self._freq[block_id] = True
        if self._t1.pop(block_id, 0) is None:
            self._t2[block_id] = None
        elif block_id in self._t2:
            self._t2.move_to_end(block_id)

    def inherit(self, donor: EvictionPolicy | None, blocks: Sequence[WarmBlock]) -> None:
        """Warm start: the donor's T1 target ``p`` and ghosts B1/B2; a live block the donor holds
        goes to the donor's list for it (T1 or T2)."""
        if not isinstance(donor, ARCPolicy):
            return super().inherit(donor, blocks)
        self.p = min(donor.p, float(self.capacity))
        self._b1 = OrderedDict(donor._b1)
        self._b2 = OrderedDict(donor._b2)
        frequent = {donor._key[b] for b in donor._t2 if b in donor._key}
        recent = {donor._key[b] for b in donor._t1 if b in donor._key}
        live = {key for _, key, _, _ in blocks}
        # Blocks the donor holds and the live cache lost become ghosts of the donor's list for them,
        # so that a recomputed one is admitted as the donor would still hold it.
        self._b1.update((k, None) for k in recent - live)
        self._b2.update((k, None) for k in frequent - live)
        for b, key, depth, reused in blocks:
            if key in frequent or key in recent:
                self._key[b] = key
                self._freq[b] = key in frequent
                (self._t2 if key in frequent else self._t1)[b] = None
            else:
                self.on_evictable(b, key, depth)
                if reused:
                    self.on_hit(b)
        self._trim()
        return None

    def resize(self, capacity: int) -> None:
        super().resize(capacity)
        self.p = min(self.p, float(capacity))  # the T1 target never exceeds the cache

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        self._t1.pop(block_id, None)
        self._t2.pop(block_id, None)
        if forget:
            self._key.pop(block_id, None)
            self._freq.pop(block_id, None)

    def victim(self) -> int:
        if self._t1 and (len(self._t1) > self.p or not self._t2):
            b, _ = self._t1.popitem(last=False)
            self._b1[self._key[b]] = None
        else:
            b, _ = self._t2.popitem(last=False)
            self._b2[self._key[b]] = None
        del self._key[b]
        self._freq.pop(b, None)
        self._trim(slack=self.capacity)
        return b

    def _trim(self, slack: int = 0) -> None:
        # Evictions run before the block that needed the room is admitted (the engine allocates,
        # computes, then publishes), so between admissions the ghosts may exceed the bound by up to
        # ``slack``; trimming strictly there would drop the very ghost about to be hit.
        c = self.capacity
        t = len(self._t1) + len(self._t2)
        while self._b1 and len(self._t1) + len(self._b1) > c + slack:
            self._b1.popitem(last=False)
        while self._b2 and t + len(self._b1) + len(self._b2) > 2 * c + slack:
            self._b2.popitem(last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def snapshot(self) -> list[tuple[int, bool]]:
        # Coldest first: T1 (LRU..MRU) then T2 (LRU..MRU).
        return [(b, False) for b in self._t1] + [(b, True) for b in self._t2]
