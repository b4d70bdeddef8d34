"""The eviction-policy contract shared by the engine and the simulator.

Evictable blocks are blocks with refcount 0 that still hold a cached hash. The block pool tells a
policy four things and asks one:

* ``on_evictable(b, key, depth, tail)`` - block ``b`` (hash ``key``, logical position ``depth`` in
  its sequence) became evictable: first time after its KV was computed, or again after being
  unpinned. ``tail`` is how many cached blocks of the releasing sequence follow it (0 = the
  deepest one; -1 = unknown). Blocks of one sequence arrive tail first.
* ``on_hit(b)`` - the cached content of ``b`` was requested again (prefix hit, or recomputed by a
  sequence that could not reach it). ``b`` may be evictable or pinned.
* ``on_remove(b, forget=False)`` - ``b`` left the evictable set because a sequence pinned it
  (``forget=False``: it will come back through ``on_evictable``) or its hash was dropped
  (``forget=True``: the policy must drop every trace of the block id, ghosts may stay).
* ``victim()`` - choose a currently evictable block, forget it (history keyed by ``key`` may be
  kept, bounded), and return its id. Only called when ``len(policy) > 0``.

Policies may keep a pinned block in place inside their queues (lazy pinning) as long as
``victim()`` never returns it; that is what keeps FIFO-like policies faithful ("hits don't move").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import ClassVar

# (block id, key, depth, was reused): an evictable block handed to a new policy on a switch
WarmBlock = tuple[int, Hashable, int, bool]


class EvictionPolicy(ABC):
    name: ClassVar[str] = "base"

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity

    @abstractmethod
    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None: ...

    @abstractmethod
    def on_hit(self, block_id: int) -> None: ...

    @abstractmethod
    def on_remove(self, block_id: int, forget: bool = False) -> None: ...

    @abstractmethod
    def victim(self) -> int: ...

    @abstractmethod
    def __len__(self) -> int:
        """Number of evictable blocks (pinned ones excluded)."""

    @abstractmethod
    def snapshot(self) -> list[tuple[int, bool]]:
        """Evictable blocks coldest first, each with "was reused" - used to carry state across a
        runtime policy switch (``KVCacheManager.set_policy``). O(n), only called on a switch."""

    def inherit(self, donor: EvictionPolicy | None, blocks: Sequence[WarmBlock]) -> None:
        """Take over the evictable ``blocks`` (block id, key, depth, was reused), coldest first, on a
        runtime switch (``KVCacheManager.set_policy``); called once on a fresh policy.

        ``donor`` is a policy of the same class that ran on the same request stream - the adaptive
        controller's ghost cache of this policy - or None. A policy that keeps key-indexed state
        (reference history, ghost lists, measured reuse) overrides this to copy the donor's, so a
        switch starts warm: a block the live cache evicted under the old policy comes back with the
        history the new policy would have had. O(donor state), only on a switch. The default
        admits the blocks and replays "was reused" as a hit."""
        for b, key, depth, reused in blocks:
            self.on_evictable(b, key, depth)
            if reused:
                self.on_hit(b)

    def resize(self, capacity: int) -> None:
        """The pool now has ``capacity`` blocks (KVCacheManager.resize; removed blocks were already
        forgotten through ``on_remove(forget=True)``). Policies that derive sizes from the capacity
        (history or ghost bounds) override this; their queues stay as they are."""
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity

    def set_clock(self, now: int) -> None:  # noqa: B027 - optional hook, only Belady uses it
        """Simulator hook: the index of the request being replayed (offline policies only)."""
