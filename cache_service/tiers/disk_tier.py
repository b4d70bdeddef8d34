"""L3 in the serving path: the disk store's files under a tier policy, fed from and read into host slots.

The DiskStore (disk_store.py) keeps verified block files under a byte budget; the LowerTier here
decides which blocks stay (its own policy, like every tier) and the hierarchy moves blocks in and
out of it. Bytes reach the disk only through host memory the cache service owns: an L2 victim is
written from its L2 slot, and a hit is read into a staging slot of the host segment, which the
compute service then copies into the device pool like an L2 hit (serving.py). At start-up the
store's files (already checked by its re-index) are admitted least recently used first, so the
tier's policy starts from the order the files were last used in.

Writes and deletions run on a writer thread, never in a plan, and so does every byte of them: a
plan hands the writer the victim's host slot itself (``write_slot``: bookkeeping only, no copy), and
the writer hashes and writes the slot's tensors where they lie. The slot is the writer's until the
file is written: the serving path gives the victim's successor another slot meanwhile, and takes the
slot back at a later plan (``take_drained``). Until the file is on disk a hit is read from that slot.
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
from collections.abc import Callable, Sequence
from typing import Protocol

from nanokv.cache_service.tiers.disk_store import DiskStore
from nanokv.cache_service.tiers.formats import TierFormat
from nanokv.cache_service.tiers.lower_tier import LowerTier
from nanokv.errors import ConfigError

log = logging.getLogger("nanokv.cache_service.tiers")
L3 = "L3"
PENDING, READY, FAILED = 0, 1, 2  # a prefetch's state


class SlotSource(Protocol):
    """The host slots a queued write's bytes sit in (cache_service/storage.py HostSlots)."""

    def views(self, slot: int) -> Sequence[memoryview]: ...

    def read(self, slot: int) -> bytes: ...


class _Queued:
    """A write waiting for the writer: its bytes (``data``), or the host slot they sit in (``slot``
    >= 0), which the tier owns until the writer is done with it; ``then(hash, slot)`` runs on the
    writer's thread once the slot's bytes are written (or were not wanted any more), before the slot
    goes back."""

    __slots__ = ("data", "slot", "then")

    def __init__(self, data: bytes | None, slot: int = -1, then: Callable[[bytes, int], None] | None = None):
        self.data, self.slot, self.then = data, slot, then


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
        self.host: SlotSource | None = None  # where write_slot's bytes sit (the serving path sets it)
        self._pending: dict[bytes, _Queued] = {}  # queued writes: served from here until on disk
        self._failed: list[bytes] = []  # writes the writer could not make (drain forgets them)
        self._slot_refs: dict[int, int] = {}  # host slot of a queued write -> its write + readers copying it
        self._drained: list[int] = []  # host slots the writer is done with (take_drained hands them back)
        self._q: queue.Queue[tuple[str, bytes, _Queued | None] | None] = queue.Queue(maxsize=max_queue)
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
        """Queue a block the tier admitted, its bytes copied out already; when the writer is too far
        behind the tier forgets it (False)."""
        return self._queue(block_hash, _Queued(payload))

    def write_slot(self, block_hash: bytes, slot: int, then: Callable[[bytes, int], None] | None = None) -> bool:
        """Queue a block the tier admitted whose bytes sit in host ``slot``: the writer reads them
        there. From now on the slot is the tier's: the caller must not let anything write into it
        until ``take_drained`` hands it back. False (the tier forgets the block, the slot stays the
        caller's) when the writer is too far behind."""
        if self.host is None:
            raise RuntimeError("disk tier: write_slot needs the host slots (DiskTier.host)")
        with self._lock:
            self._slot_refs[slot] = 1
        if self._queue(block_hash, _Queued(None, slot, then)):
            return True
        with self._lock:
            del self._slot_refs[slot]
        return False

    def _queue(self, block_hash: bytes, job: _Queued) -> bool:
        with self._lock:
            self._pending[block_hash] = job
        try:
            self._q.put_nowait(("put", block_hash, job))
        except queue.Full:
            with self._lock:
                if self._pending.get(block_hash) is job:
                    del self._pending[block_hash]
            self.shed(block_hash)
            return False
        return True

    def shed(self, block_hash: bytes) -> None:
        """The writer is too far behind to take the block: the tier forgets it."""
        self.queue_full += 1
        self.forget(block_hash)

    def take_drained(self) -> list[int]:
        """The host slots of ``write_slot``'s writes that are done with (written, failed or no longer
        wanted, and no reader copying them): the caller's again."""
        with self._lock:
            out, self._drained = self._drained, []
        return out

    def draining(self) -> int:
        """Host slots the tier holds (queued writes not done yet)."""
        with self._lock:
            return len(self._slot_refs)

    def _release(self, slot: int) -> None:
        """(Under the lock) one holder of a queued write's slot is done with it."""
        self._slot_refs[slot] -= 1
        if self._slot_refs[slot] == 0:
            del self._slot_refs[slot]
            self._drained.append(slot)

    def _pending_bytes(self, block_hash: bytes) -> bytes | None:
        """A copy of a queued write's bytes (from its slot, which is held meanwhile), or None."""
        with self._lock:
            job = self._pending.get(block_hash)
            if job is None or job.slot < 0:
                return None if job is None else job.data
            self._slot_refs[job.slot] += 1
        try:
            assert self.host is not None  # (write_slot checked)
            return self.host.read(job.slot)
        finally:
            with self._lock:
                self._release(job.slot)

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
        data = self._pending_bytes(block_hash)
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
            try:
                data = self._pending_bytes(h)
            except Exception:  # noqa: BLE001 - reported as a failed read below
                log.exception("disk tier (L3): copying a queued write of %s failed", h.hex()[:16])
                data = None
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
            self._q.put_nowait(("rm", block_hash, None))
        except queue.Full:
            self.store.remove(block_hash)

    def _write_loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            op, h, job = item
            if job is None:  # op "rm"
                self.store.remove(h)
                continue
            with self._lock:
                wanted = self._pending.get(h) is job  # not removed (or re-queued) since
            try:
                ok = self._put(h, job) if wanted else True
                if job.then is not None:
                    job.then(h, job.slot)
            except Exception:  # noqa: BLE001 - a failed write, and its slot still goes back
                log.exception("disk tier (L3): writing %s failed", h.hex()[:16])
                ok = False
            with self._lock:
                if self._pending.get(h) is job:
                    del self._pending[h]
                if not ok:
                    self._failed.append(h)
                if job.slot >= 0:
                    self._release(job.slot)

    def _put(self, h: bytes, job: _Queued) -> bool:
        if job.slot < 0:
            return self.store.put(h, job.data)
        assert self.host is not None  # (write_slot checked)
        return self.store.put(h, list(self.host.views(job.slot)))

    def close(self) -> None:
        """Finish the queued writes (a clean shutdown keeps every block it admitted), stop the writer."""
        self._q.put(None)
        self._rq.put(None)
        self._writer.join(timeout=60)
        self._reader.join(timeout=10)
