"""L3 in the serving path: the disk store's files under a tier policy, fed from and read into host slots.

The DiskStore (disk_store.py) keeps verified block files under a byte budget; the LowerTier here
decides which blocks stay (its own policy, like every tier) and the hierarchy moves blocks in and
out of it. Bytes reach the disk only through host memory the cache service owns: an L2 victim is
written from its L2 slot, and a hit is read into a staging slot of the host segment, which the
compute service then copies into the device pool like an L2 hit (serving.py). At start-up the
store's files (already checked by its re-index) are admitted least recently used first, so the
tier's policy starts from the order the files were last used in.

Writes and deletions run on a writer thread, never in a plan: a plan copies the victim's bytes out
of its slot (a memcpy) and queues them; until the file is on disk a hit is served from that copy.
A full queue (the disk slower than the evictions) drops the block instead of waiting; a write that
fails is reported back and the tier forgets the block at the next plan (``drain``).

Reads run on a reader thread too: a hit asks for its blocks (``prefetch``: the file read, its
checksum checked, the payload written into a staging slot the caller reserved) and its sequence
waits, out of the batch, while the others keep running; a later plan finds the blocks ``READY``
(or ``FAILED``: the chain ends there and the rest is computed). Only the plan's thread changes the
tier's index.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from nanokv.cache_service.tiers.disk_store import DiskStore
from nanokv.cache_service.tiers.formats import TierFormat
from nanokv.cache_service.tiers.lower_tier import LowerTier
from nanokv.errors import ConfigError

log = logging.getLogger("nanokv.cache_service.tiers")
L3 = "L3"
PENDING, READY, FAILED = 0, 1, 2  # a prefetch's state


class DiskTier:
    def __init__(self, store: DiskStore, payload_bytes: int, bits: int, policy: str = "lru", max_queue: int = 256):
        self.store = store
        self.payload_bytes = payload_bytes
        capacity = store.capacity_bytes // store.charge(payload_bytes)
        if capacity < 1:
            raise ConfigError("disk_cache_bytes", f"{store.capacity_bytes} bytes hold no block file of "
                                                  f"{store.charge(payload_bytes)} bytes")
        self.tier = LowerTier(L3, capacity, TierFormat("pool", bits, payload_bytes), policy, keep_on_load=True)
        self.write_failed = 0  # victims L2 could not write down (disk full, I/O error, bytes in flight)
        self.read_failed = 0  # hits whose file was gone, corrupt or slow: recomputed instead
        self.queue_full = 0  # victims dropped because the writer was too far behind
        self._lock = threading.Lock()
        self._pending: dict[bytes, bytes] = {}  # queued writes: served from here until on disk
        self._failed: list[bytes] = []  # writes the writer could not make (drain forgets them)
        self._q: queue.Queue[tuple[str, bytes, bytes] | None] = queue.Queue(maxsize=max_queue)
        self._writer = threading.Thread(target=self._write_loop, name="nanokv-disk-tier", daemon=True)
        self._writer.start()
        self._reads: dict[bytes, int] = {}  # prefetched block -> PENDING / READY / FAILED
        self._rq: queue.Queue[tuple[bytes, int, Callable[[int, bytes], None]] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_loop, name="nanokv-disk-tier-reader", daemon=True)
        self._reader.start()
        kept = 0
        for e in store.entries():  # least recently used first
            if e.payload_bytes != payload_bytes:
                store.remove(e.block_hash)  # another layout's block (same fingerprint cannot say so)
                continue
            admitted, victim = self.tier.admit(e.block_hash, 0)
            if victim is not None:  # more files than this budget's blocks: the oldest go
                store.remove(victim[0])
            kept += admitted
        if kept:
            log.info("disk tier (L3): %d blocks indexed from %s", kept, store.dir)

    def write(self, block_hash: bytes, payload: bytes) -> bool:
        """Queue a block the tier admitted; when the writer is too far behind the tier forgets it (False)."""
        with self._lock:
            self._pending[block_hash] = payload
        try:
            self._q.put_nowait(("put", block_hash, payload))
        except queue.Full:
            with self._lock:
                self._pending.pop(block_hash, None)
            self.queue_full += 1
            self.forget(block_hash)
            return False
        return True

    def forget(self, block_hash: bytes) -> None:
        """The tier's copy cannot be had (not written, or unreadable): drop it from the index."""
        self.write_failed += 1
        self.tier.discard(block_hash)

    def drain(self) -> None:
        """At a plan: forget the blocks whose writes failed since the last one."""
        with self._lock:
            failed, self._failed = self._failed, []
        for h in failed:
            self.forget(h)

    def read(self, block_hash: bytes) -> bytes | None:
        with self._lock:
            data = self._pending.get(block_hash)
        if data is None:
            data = self.store.get(block_hash)
        if data is None or len(data) != self.payload_bytes:
            self.read_failed += 1
            self.tier.discard(block_hash)
            self.remove(block_hash)
            return None
        return data

    def prefetch(self, block_hash: bytes, slot: int, sink: Callable[[int, bytes], None]) -> None:
        """Read the block on the reader thread into `slot` (sink(slot, payload)); ``state`` says when."""
        with self._lock:
            self._reads[block_hash] = PENDING
        self._rq.put((block_hash, slot, sink))

    def state(self, block_hash: bytes) -> int | None:
        with self._lock:
            return self._reads.get(block_hash)

    def settle(self, block_hash: bytes) -> bool:
        """The plan takes a prefetch's outcome: True if its payload is in its slot; a failed read
        drops the block from the tier (its file was gone, corrupt or cut short)."""
        with self._lock:
            st = self._reads.pop(block_hash, None)
        if st == READY:
            return True
        self.read_failed += 1
        self.tier.discard(block_hash)
        self.remove(block_hash)
        return False

    def drop_read(self, block_hash: bytes) -> None:
        """A prefetch nobody took (its sequence left, or the block left the tier): forget it."""
        with self._lock:
            self._reads.pop(block_hash, None)

    def _read_loop(self) -> None:
        while True:
            job = self._rq.get()
            if job is None:
                return
            h, slot, sink = job
            with self._lock:
                data = self._pending.get(h)
            if data is None:
                data = self.store.get(h)
            ok = data is not None and len(data) == self.payload_bytes
            if ok and data is not None:
                try:
                    sink(slot, data)
                except Exception:  # noqa: BLE001 - reported as a failed read, never lost silently
                    log.exception("disk tier (L3): staging a read of %s failed", h.hex()[:16])
                    ok = False
            with self._lock:
                if h in self._reads:
                    self._reads[h] = READY if ok else FAILED

    def remove(self, block_hash: bytes) -> None:
        """The tier evicted or dropped the block: its file goes (after any queued write of it)."""
        with self._lock:
            self._pending.pop(block_hash, None)
        try:
            self._q.put_nowait(("rm", block_hash, b""))
        except queue.Full:
            self.store.remove(block_hash)

    def _write_loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            op, h, data = job
            if op == "rm":
                self.store.remove(h)
                continue
            with self._lock:
                wanted = self._pending.get(h) is data  # not removed (or re-queued) since
            ok = self.store.put(h, data) if wanted else True
            with self._lock:
                if self._pending.get(h) is data:
                    del self._pending[h]
                if not ok:
                    self._failed.append(h)

    def close(self) -> None:
        """Finish the queued writes (a clean shutdown keeps every block it admitted), stop the writer."""
        self._q.put(None)
        self._rq.put(None)
        self._writer.join(timeout=60)
        self._reader.join(timeout=10)
