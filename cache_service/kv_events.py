"""KV events: what a cache publishes about its blocks, for a KV-aware router (router/).

Names follow vLLM's KV-events schema where they fit: BlockStored (block hashes, the parent of the
first, token count, medium), BlockRemoved (block hashes, medium), AllBlocksCleared. ``medium`` is
the tier ("L1" the device pool; lower tiers publish under their own names).

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
L1 = "L1"
DEFAULT_CAPACITY = 65536


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
    def __init__(self, capacity: int = DEFAULT_CAPACITY, block_size: int = 0, hash_algo: str = "sha256"):
        if capacity < 1:
            raise ValueError(f"capacity: got {capacity}; must be >= 1")
        self.stream_id = uuid.uuid4().hex
        self.block_size = block_size
        self.hash_algo = hash_algo
        self._ring: deque[KVEvent] = deque(maxlen=capacity)
        self._cached: dict[str, dict[bytes, bytes]] = {}  # medium -> {hash: parent}
        self._seq = 0
        self._cond = threading.Condition()

    # ---- publishing (the cache manager, under the cache service's lock) ----------------------------
    def stored(self, block_hash: bytes, parent: bytes, token_count: int, medium: str = L1) -> None:
        with self._cond:
            self._cached.setdefault(medium, {})[block_hash] = parent
            self._append(STORED, (block_hash,), parent, token_count, medium)

    def removed(self, block_hash: bytes, medium: str = L1) -> None:
        with self._cond:
            if self._cached.get(medium, {}).pop(block_hash, None) is None:
                return  # never published (e.g. a block cached before the log was attached)
            self._append(REMOVED, (block_hash,), b"", 0, medium)

    def cleared(self, medium: str = "") -> None:
        """Every block of ``medium`` is gone ("" = of every medium: a new pool, a reset)."""
        with self._cond:
            if medium:
                self._cached.pop(medium, None)
            else:
                self._cached.clear()
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
