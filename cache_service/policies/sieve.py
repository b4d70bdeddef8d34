"""SIEVE (Zhang et al., NSDI'24): one FIFO, a visited bit, and a hand that survivors never leave.

New blocks enter at the head with visited = 0; a hit sets the bit. The hand starts at the tail and
walks toward the head, clearing set bits and evicting the first unvisited block; it remembers where
it stopped and wraps to the tail. Unlike CLOCK, survivors stay in place.

Cost: O(1) insert/hit/remove (an intrusive doubly linked list in two dicts); ``victim()`` is
amortized O(1): every bit cleared was paid for by a hit. A pinned block is handled like any other
until the hand would evict it; then it is unlinked ("parked") and re-enters at the head when freed.
"""

from __future__ import annotations

from collections.abc import Hashable

from nanokv.cache_service.policies.base import EvictionPolicy


class SievePolicy(EvictionPolicy):
    name = "sieve"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._newer: dict[int, int | None] = {}  # towards the head
        self._older: dict[int, int | None] = {}  # towards the tail
        self._head: int | None = None
        self._tail: int | None = None
        self._hand: int | None = None
        self._visited: dict[int, bool] = {}  # every block the policy knows (linked or not)
        self._pinned: set[int] = set()  # pinned blocks still linked
        self._reused: set[int] = set()

    # ---- intrusive list ------------------------------------------------------------------------
    def _push_head(self, b: int) -> None:
        self._newer[b] = None
        self._older[b] = self._head
        if self._head is not None:
            self._newer[self._head] = b
        self._head = b
        if self._tail is None:
            self._tail = b

    def _unlink(self, b: int) -> None:
        newer, older = self._newer.pop(b), self._older.pop(b)
        if newer is None:
            self._head = older
        else:
            self._older[newer] = older
        if older is None:
            self._tail = newer
        else:
            self._newer[older] = newer
        if self._hand == b:
            self._hand = newer

    # ---- contract --------------------------------------------------------------------------------
    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        if block_id in self._newer:
            self._pinned.discard(block_id)  # unpinned in place
            return
        self._visited.setdefault(block_id, False)  # parked blocks keep their bit
        self._push_head(block_id)

    def on_hit(self, block_id: int) -> None:
        self._visited[block_id] = True
        self._reused.add(block_id)

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        if forget:
            if block_id in self._newer:
                self._unlink(block_id)
            self._pinned.discard(block_id)
            self._visited.pop(block_id, None)
            self._reused.discard(block_id)
        elif block_id in self._newer:
            self._pinned.add(block_id)

    def victim(self) -> int:
        b = self._hand if self._hand is not None else self._tail
        while True:
            assert b is not None  # internal: victim() is only called with evictable blocks linked
            nxt = self._newer[b]
            if self._visited[b]:
                self._visited[b] = False
            elif b in self._pinned:
                self._pinned.discard(b)
                self._unlink(b)  # parked until freed
            else:
                self._hand = nxt
                self._unlink(b)
                del self._visited[b]
                self._reused.discard(b)
                return b
            b = nxt if nxt is not None else self._tail

    def __len__(self) -> int:
        return len(self._newer) - len(self._pinned)

    def snapshot(self) -> list[tuple[int, bool]]:
        out = []
        b = self._tail
        while b is not None:
            if b not in self._pinned:
                out.append((b, b in self._reused))
            b = self._newer[b]
        return out
