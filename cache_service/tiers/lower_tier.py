"""One tier below the device pool (host memory, disk): an index of resident blocks and its policy.

The tier moves no data. It decides what is resident, which block leaves to make room, and tells
the hierarchy (``hierarchy.TieredCache``), which turns that into movements between tiers. Blocks
are keyed by the manager's salted chained block hash, so equal keys mean equal content and two
tenants never share a key. Each resident block sits in a *slot* (0..capacity-1): the place its
bytes would occupy in the tier's buffer or file, which the engine's copies will address.

A slot is in one of three states, like a device block (block_pool.py):
  * evictable - resident, owned by the eviction policy,
  * pinned    - resident and being loaded into L1 (``pin``/``unpin``): never a victim meanwhile,
  * free      - on the free list.
Every operation is O(1) plus the policy's cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nanokv.cache_service.policies import make_policy
from nanokv.cache_service.tiers.formats import TierFormat
from nanokv.errors import NanoKVError

Victim = tuple[bytes, int]  # (block hash, depth) of a block that left the tier


class LowerTier:
    def __init__(self, name: str, capacity: int, fmt: TierFormat, policy: str = "lru",
                 policy_kwargs: dict[str, Any] | None = None, *, keep_on_load: bool = False) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise NanoKVError(f"{name} capacity", f"got {capacity!r}; must be an integer >= 1 block")
        self.name = name
        self.capacity = capacity
        self.format = fmt
        self.policy_name = policy
        self.policy = make_policy(policy, capacity, **(policy_kwargs or {}))
        # after a load into L1 lands: keep this copy as a replica (True) or drop it (False), see hierarchy.py
        self.keep_on_load = keep_on_load
        self._slot: dict[bytes, int] = {}
        self._key: list[bytes | None] = [None] * capacity
        self._depth = [0] * capacity
        self._pins = [0] * capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first
        self.num_evictable = 0
        # monotonic counters (the hierarchy reports them)
        self.admitted = 0  # blocks written in
        self.evictions = 0  # policy victims
        self.discarded = 0  # copies removed without eviction (a load made L1 the only owner)
        # on_resident(hash, resident): a block became resident (True) or left (False) by any path;
        # the KV-event log publishes it (tiers/serving.py)
        self.on_resident: Callable[[bytes, bool], None] | None = None

    # ---- queries ------------------------------------------------------------------------------
    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._slot

    def __len__(self) -> int:
        """Occupancy in blocks (pinned ones included)."""
        return len(self._slot)

    def slot(self, block_hash: bytes) -> int | None:
        return self._slot.get(block_hash)

    def bytes_used(self) -> int:
        return len(self._slot) * self.format.bytes_per_block

    def capacity_bytes(self) -> int:
        return self.capacity * self.format.bytes_per_block

    def keys(self) -> list[bytes]:
        """Every resident hash (O(occupancy): tests and reports only)."""
        return list(self._slot)

    # ---- state changes -----------------------------------------------------------------------
    def admit(self, block_hash: bytes, depth: int) -> tuple[bool, Victim | None]:
        """Make ``block_hash`` resident (the caller writes its bytes into the slot). Returns (admitted,
        victim): the block evicted to make room, if any. Not admitted only when every slot is pinned.
        A hash already resident is refreshed as a hit instead."""
        s = self._slot.get(block_hash)
        if s is not None:
            self.policy.on_hit(s)
            return True, None
        victim: Victim | None = None
        if self._free:
            s = self._free.pop()
        elif self.num_evictable:
            s = self.policy.victim()
            old = self._key[s]
            if old is None or self._pins[s]:
                raise RuntimeError(f"{self.name}: policy {self.policy_name} chose slot {s}, which is not evictable")
            del self._slot[old]
            self.num_evictable -= 1
            self.evictions += 1
            victim = (old, self._depth[s])
            if self.on_resident is not None:
                self.on_resident(old, False)
        else:
            return False, None
        self._slot[block_hash] = s
        self._key[s] = block_hash
        self._depth[s] = depth
        self.num_evictable += 1
        self.admitted += 1
        self.policy.on_evictable(s, block_hash, depth)
        if self.on_resident is not None:
            self.on_resident(block_hash, True)
        return True, victim

    def touch(self, block_hash: bytes) -> None:
        """The block was used again (its owner above handed it down, or it was requested)."""
        s = self._slot.get(block_hash)
        if s is not None:
            self.policy.on_hit(s)

    def pin(self, block_hash: bytes) -> None:
        """A load into L1 starts: the block is a hit, and no victim until ``unpin``."""
        s = self._slot[block_hash]
        self.policy.on_hit(s)
        if self._pins[s] == 0:
            self.policy.on_remove(s)
            self.num_evictable -= 1
        self._pins[s] += 1

    def unpin(self, block_hash: bytes) -> None:
        s = self._slot[block_hash]
        if self._pins[s] == 0:
            raise RuntimeError(f"{self.name}: block unpinned more often than pinned")
        self._pins[s] -= 1
        if self._pins[s] == 0:
            self.num_evictable += 1
            self.policy.on_evictable(s, block_hash, self._depth[s])

    def discard(self, block_hash: bytes) -> bool:
        """Remove an unpinned copy (its owner is elsewhere now). False if not resident or pinned."""
        s = self._slot.get(block_hash)
        if s is None or self._pins[s]:
            return False
        self.policy.on_remove(s, forget=True)
        del self._slot[block_hash]
        self._key[s] = None
        self.num_evictable -= 1
        self._free.append(s)
        self.discarded += 1
        if self.on_resident is not None:
            self.on_resident(block_hash, False)
        return True
