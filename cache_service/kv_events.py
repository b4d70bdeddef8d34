"""KV events: what a cache publishes about its blocks, for a KV-aware router (router/).

Names follow vLLM's KV-events schema where they fit: BlockStored (block hashes, the parent of the
first, token count, medium), BlockRemoved (block hashes, medium), AllBlocksCleared. ``medium`` is
the tier, in vLLM's values: "GPU" for the engine's own pool (L1; vLLM says GPU for it whatever the
device, and so do we, on a CPU build too), "CPU" for the host tier (L2, what vLLM's CPU offloading
publishes), "DISK" for L3 and "REMOTE" for the shared tier on Valkey. A router written for vLLM's
events (per-medium weights keyed "GPU"/"CPU") reads ours unchanged. A move between tiers is a
BlockStored in the lower tier followed by a BlockRemoved in the upper one (vLLM has no move event);
a block dropped from the lowest tier is a BlockRemoved there.

The shared tier is written by every replica and evicts by TTL and memory on a server none of them
watches, so its entries here say "this cache put it there" and are kept for the last
``remote_capacity`` puts only (an older one is published as removed: the router forgets it too).

The log is a bounded ring of events with sequence numbers 1, 2, 3, ... (per log: ``stream_id``
names the incarnation, so a subscriber of a restarted cache never mixes two numberings). Beside it
the log keeps what is cached now (hash -> parent per medium), so a subscriber whose last sequence
number fell out of the ring, or who starts fresh, gets a snapshot and then the live events.
Publishing is a deque append and a dict update: O(1) per block, under the log's own lock.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
GPU, CPU, DISK, REMOTE = "GPU", "CPU", "DISK", "REMOTE"
L1 = GPU  # the device pool's medium
# the hierarchy's level names (tiers/hierarchy.py, /metrics) -> the medium their events carry
MEDIUM_OF_LEVEL = {"L1": GPU, "L2": CPU, "L3": DISK, "remote": REMOTE}
SHARED_MEDIA = (REMOTE,)  # reachable by every replica sharing the server: no affinity to this one
DEFAULT_CAPACITY = 65536
RECENT_PARENTS = 4096  # parents of just-removed blocks: a block moving down is removed above first


@dataclass(frozen=True)
class KVEvent:
    seq: int
    kind: str  # STORED, REMOVED or CLEARED
    block_hashes: tuple[bytes, ...] = ()
    parent: bytes = b""  # of block_hashes[0] (b"": a first block, whose parent is the salted root)
    token_count: int = 0  # tokens the stored blocks hold (block_size each)
    medium: str = L1  # CLEARED with "" clears every medium


@dataclass
class Catchup:
    """What a subscriber reads next: ``snapshot`` True means ``events`` start with CLEARED and then
    hold every cached block (the subscriber drops what it knew first)."""
    stream_id: str
    snapshot: bool
    events: list[KVEvent]
    last_seq: int


class KVEventLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, block_size: int = 0, hash_algo: str = "sha256",
                 remote_capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity: got {capacity}; must be >= 1")
        if remote_capacity < 1:
            raise ValueError(f"remote_capacity: got {remote_capacity}; must be >= 1")
        self.remote_capacity = remote_capacity
        self.stream_id = uuid.uuid4().hex
        self.block_size = block_size
        self.hash_algo = hash_algo
        self._ring: deque[KVEvent] = deque(maxlen=capacity)
        self._cached: dict[str, dict[bytes, bytes]] = {}  # medium -> {hash: parent}
        self._recent: dict[bytes, bytes] = {}  # hash -> parent of blocks just removed (oldest first)
        self._seq = 0
        self._cond = threading.Condition()

    # ---- publishing (the cache manager, under the cache service's lock) ----------------------------
    def stored(self, block_hash: bytes, parent: bytes | None, token_count: int, medium: str = L1) -> None:
        """``parent`` None: the caller does not know it (a lower tier, which keys blocks by hash only);
        the log takes it from the block's copy in another medium or its recent removal there."""
        with self._cond:
            if parent is None:
                parent = self._parent_of(block_hash)
            blocks = self._cached.setdefault(medium, {})
            if medium == REMOTE:
                blocks.pop(block_hash, None)  # a put again is the newest
                if len(blocks) >= self.remote_capacity:
                    old = next(iter(blocks))
                    del blocks[old]
                    self._append(REMOVED, (old,), b"", 0, medium)
            blocks[block_hash] = parent
            self._append(STORED, (block_hash,), parent, token_count, medium)

    def removed(self, block_hash: bytes, medium: str = L1) -> None:
        with self._cond:
            parent = self._cached.get(medium, {}).pop(block_hash, None)
            if parent is None:
                return  # never published (e.g. a block cached before the log was attached)
            recent = self._recent
            recent[block_hash] = parent
            if len(recent) > RECENT_PARENTS:
                del recent[next(iter(recent))]
            self._append(REMOVED, (block_hash,), b"", 0, medium)

    def _parent_of(self, block_hash: bytes) -> bytes:
        for blocks in self._cached.values():
            p = blocks.get(block_hash)
            if p is not None:
                return p
        return self._recent.get(block_hash, b"")  # b"": unknown (a disk block indexed at start-up)

    def cleared(self, medium: str = "") -> None:
        """Every block of ``medium`` is gone ("" = of every medium: a new pool, a reset)."""
        with self._cond:
            if medium:
                self._cached.pop(medium, None)
            else:
                self._cached.clear()
                self._recent.clear()
            self._append(CLEARED, (), b"", 0, medium)

    def _append(self, kind: str, hashes: tuple[bytes, ...], parent: bytes, tokens: int, medium: str) -> None:
        self._seq += 1
        self._ring.append(KVEvent(self._seq, kind, hashes, parent, tokens, medium))
        self._cond.notify_all()

    # ---- reading (subscribers) -------------------------------------------------------------------
    @property
    def last_seq(self) -> int:
        return self._seq

    def num_cached(self, medium: str = L1) -> int:
        with self._cond:
            return len(self._cached.get(medium, {}))

    def read(self, after_seq: int, stream_id: str = "", limit: int = 4096) -> Catchup:
        """Events after ``after_seq`` of stream ``stream_id`` (at most ``limit``), or a snapshot when
        the stream is another one ("" included) or the ring no longer holds seq after_seq + 1."""
        with self._cond:
            ring = self._ring
            first = ring[0].seq if ring else self._seq + 1
            if stream_id == self.stream_id and first - 1 <= after_seq <= self._seq:
                start = after_seq - first + 1  # ring positions are seq - first (seqs are consecutive)
                events = [ring[i] for i in range(start, min(len(ring), start + limit))]
                return Catchup(self.stream_id, False, events, events[-1].seq if events else after_seq)
            snap = [KVEvent(self._seq, CLEARED)]
            for medium, blocks in self._cached.items():
                snap += [KVEvent(self._seq, STORED, (h,), p, self.block_size, medium) for h, p in blocks.items()]
            return Catchup(self.stream_id, True, snap, self._seq)

    def wait(self, after_seq: int, timeout_s: float) -> bool:
        """Block until an event after ``after_seq`` exists (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._seq <= after_seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True
