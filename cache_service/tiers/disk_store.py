"""L3 of the KV cache hierarchy: a directory of block files under a byte budget (``disk_cache_dir``,
``disk_cache_bytes``). One file per block, named by its salted chained hash (cache_service/hashing.py),
so a tenant can only ever find blocks of its own salt. Pure Python: payloads are opaque bytes.

What is verified when (file layout: disk_format.py):
  start-up  every file's 184-byte header: magic, version, header digest, fingerprint, name = hash,
            size = header + payload. Foreign, corrupt and truncated files are deleted; temp files of
            an interrupted write are deleted; the oldest blocks beyond the budget are deleted.
            Payload checksums are NOT read here: that would read the whole tier (a TB at disk
            speed) before the service could start.
  get       header again plus the payload checksum; a bad file is deleted, counted, logged and
            reported as a miss, so nothing unverified is ever served.
Writes go to a temp file (O_EXCL, 0o600) renamed over the final name, so a crash leaves either no
file or a whole one. Faults never raise out of put/get: a full disk (ENOSPC/EDQUOT) or a read-only
one stops admission (one warning, a counter) until ``retry_after_s`` passes or the store frees
space; a slow disk is cut off by ``timeout_s`` (disk_io.BoundedRunner) and counted as a miss.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator

from nanokv.cache_service.tiers.disk_format import (
    HASH_BYTES,
    HEADER_SIZE,
    BadFile,
    check_payload,
    fingerprint_digest,
    pack_header,
    parse_header,
)
from nanokv.cache_service.tiers.disk_io import BoundedRunner, DiskIO, IOBusy, IOTimeout, open_cache_dir
from nanokv.cache_service.tiers.disk_reindex import DiskEntry, ReindexReport, reindex
from nanokv.errors import ConfigError, NanoKVError

log = logging.getLogger("nanokv.cache_service.disk")

SUFFIX, TMP_PREFIX = ".kvb", ".tmp-"
_FULL = {errno.ENOSPC, errno.EDQUOT}
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}
DROP_KINDS = ("corrupt", "foreign", "truncated", "unsafe", "missing", "over_budget")
COUNTERS = ("puts", "puts_admitted", "gets", "hits", "misses", "evicted", "temp_removed", "io_errors",
            "timeouts", "busy", "admit_refused_full", "admit_refused_disk_full", "admit_refused_unavailable",
            "bytes_written", "bytes_read") + tuple(f"{k}_dropped" for k in DROP_KINDS)


class _PutJob:
    __slots__ = ("abandoned", "finished", "admitted")

    def __init__(self) -> None:
        self.abandoned = self.finished = self.admitted = False


def file_name(block_hash: bytes) -> str:
    return block_hash.hex() + SUFFIX


def _hash_of(name: str) -> bytes | None:
    stem = name[:-len(SUFFIX)]
    if not name.endswith(SUFFIX) or len(stem) != 2 * HASH_BYTES:
        return None
    try:
        h = bytes.fromhex(stem)
    except ValueError:
        return None
    return h if h.hex() == stem else None  # lower-case hex only: one name per block


def _check_hash(field: str, value: object) -> bytes:
    if not isinstance(value, bytes) or len(value) != HASH_BYTES:
        got = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise NanoKVError(field, f"must be a {HASH_BYTES}-byte block hash (cache_service/hashing.py), got {got}")
    return value


class DiskStore:
    """A byte-budgeted directory of verified KV block files; thread-safe; one store per directory
    (a lock file refuses a second one). Order of ``keys()``: least recently used first (insertion
    and hits; after a restart, file mtime, which a hit refreshes), for a caller's eviction."""

    def __init__(self, dir: str, capacity_bytes: int, fingerprint: bytes | str, *, fsync: bool = False,
                 timeout_s: float | None = 5.0, io_workers: int = 4, retry_after_s: float = 30.0,
                 io: DiskIO | None = None):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ConfigError("disk_cache_bytes", f"must be an integer >= 0, got {capacity_bytes!r}")
        if not fingerprint:
            raise ConfigError("fingerprint", "must name the model and KV format (non-empty bytes or str)")
        if timeout_s is not None and not timeout_s > 0:
            raise ConfigError("timeout_s", f"must be > 0 seconds or None (no deadline), got {timeout_s!r}")
        if io_workers < 1:
            raise ConfigError("io_workers", f"must be >= 1, got {io_workers!r}")
        self.dir, self.capacity_bytes, self.fsync = dir, capacity_bytes, fsync
        self.retry_after_s = retry_after_s
        self._fp = fingerprint_digest(fingerprint)
        self._io = io or DiskIO()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, DiskEntry] = OrderedDict()
        self._pending: set[bytes] = set()  # blocks with a write or delete in flight
        self._used = self._reserved = 0
        self._count: Counter[str] = Counter()
        self._blocked: str | None = None  # why admission stopped: disk_full / read_only
        self._blocked_until = 0.0
        self._blocked_used = 0
        self._closed = False
        self._warned: dict[str, float] = {}
        self._fd = open_cache_dir(dir)
        try:
            self._fs_block = os.fstatvfs(self._fd).f_frsize or 4096
            self.reindex_report = self._load()
        except BaseException:
            os.close(self._fd)
            raise
        self._runner = BoundedRunner(timeout_s, io_workers)

    # ---- the API -----------------------------------------------------------------------------
    def put(self, block_hash: bytes, payload: object, parent_hash: bytes | None = None) -> bool:
        """Store a block; True once it is on disk under its name (or already was). False, never an
        exception, when it is not admitted: the budget is full (evict first: ``evict_for``), the
        disk is full or read-only, the write failed or outran ``timeout_s``."""
        _check_hash("block_hash", block_hash)
        if parent_hash is not None:
            _check_hash("parent_hash", parent_hash)
        view = memoryview(payload)  # type: ignore[arg-type]  # any buffer-protocol object
        if view.ndim != 1 or view.format not in ("B", "b", "c"):
            view = view.cast("B")
        charge = self.charge(view.nbytes)
        with self._lock:
            self._live()
            self._count["puts"] += 1
            if block_hash in self._index:
                return True  # content-addressed: same salted chained hash and fingerprint, same KV
            if block_hash in self._pending:
                self._count["busy"] += 1
                return False
            if not self._may_admit():
                self._count["admit_refused_unavailable"] += 1
                return False
            if self._used + self._reserved + charge > self.capacity_bytes:
                self._count["admit_refused_full"] += 1
                return False
            self._reserved += charge
            self._pending.add(block_hash)
        job = _PutJob()
        try:
            return self._runner.run(self._put_job, job, block_hash, parent_hash, view, charge)
        except (IOTimeout, IOBusy) as exc:
            with self._lock:
                if job.finished:
                    return job.admitted
                job.abandoned = True  # the worker takes its file back when it finishes
                if isinstance(exc, IOBusy):  # never started
                    self._reserved -= charge
                    self._pending.discard(block_hash)
            self._slow("put", exc)
            return False

    def get(self, block_hash: bytes) -> bytes | None:
        """The payload, verified against its header and checksum; None on a miss, a bad file (deleted,
        counted, logged), an I/O error or a read slower than ``timeout_s``."""
        with self._lock:
            self._live()
            self._count["gets"] += 1
            known = block_hash in self._index
        data = None
        if known:
            try:
                data = self._runner.run(self._get_job, block_hash)
            except (IOTimeout, IOBusy) as exc:
                self._slow("get", exc)
        with self._lock:
            self._count["hits" if data is not None else "misses"] += 1
        return data

    def contains(self, block_hash: bytes) -> bool:
        """Indexed (no I/O); a get may still miss if the file turns out bad."""
        with self._lock:
            return block_hash in self._index

    __contains__ = contains

    def remove(self, block_hash: bytes) -> bool:
        """Forget a block and delete its file; False if it was not stored or no worker was free."""
        with self._lock:
            self._live()
            entry = self._index.pop(block_hash, None)
            if entry is None:
                return False
            self._used -= entry.charged_bytes
            self._pending.add(block_hash)
        try:
            self._runner.run(self._unlink_job, block_hash)
        except IOBusy as exc:
            with self._lock:  # nothing ran: the block stays stored
                self._index[block_hash] = entry
                self._index.move_to_end(block_hash, last=False)
                self._used += entry.charged_bytes
                self._pending.discard(block_hash)
            self._slow("remove", exc)
            return False
        except IOTimeout as exc:
            self._slow("remove", exc)  # unindexed already; the worker finishes the unlink
        return True

    def evict_for(self, payload_bytes: int) -> list[bytes]:
        """Remove least recently used blocks until a payload of this size fits the budget; the
        removed hashes, oldest first (the tier policy may evict in its own order instead)."""
        need = self.charge(payload_bytes)
        if need > self.capacity_bytes:
            return []
        out: list[bytes] = []
        while True:
            with self._lock:
                if self._used + self._reserved + need <= self.capacity_bytes or not self._index:
                    return out
                victim = next(iter(self._index))
            if self.remove(victim):
                out.append(victim)
                with self._lock:
                    self._count["evicted"] += 1
            else:
                return out

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def entries(self) -> list[DiskEntry]:
        """Every block with its parent hash (to rebuild prefix chains), least recently used first."""
        with self._lock:
            return list(self._index.values())

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._index)

    def charge(self, payload_bytes: int) -> int:
        """Budget bytes one block of this payload size costs (header included, block-rounded)."""
        return -(-(HEADER_SIZE + payload_bytes) // self._fs_block) * self._fs_block

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def admitting(self) -> bool:
        """False while a full or read-only disk holds admission back (until the retry is due)."""
        with self._lock:
            return self._may_admit()

    @property
    def admit_reason(self) -> str:
        """"ok", or why the last write was refused by the disk ("disk_full", "read_only") until a
        later write succeeds."""
        return self._blocked or "ok"

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {f"disk_tier_{k}_total": self._count[k] for k in COUNTERS}
            out.update(disk_tier_used_bytes=self._used, disk_tier_capacity_bytes=self.capacity_bytes,
                       disk_tier_blocks=len(self._index), disk_tier_admitting=int(self._may_admit()))
        return out

    def close(self) -> None:
        """Stop; the directory lock is released once any stalled worker has finished."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._runner.close(self._close_fds)

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- workers (run on the runner's threads; they do their own accounting) ----------------
    def _put_job(self, job: _PutJob, h: bytes, parent: bytes | None, view: memoryview, charge: int) -> bool:
        tmp = f"{TMP_PREFIX}{h.hex()}-{secrets.token_hex(4)}"
        try:
            header = pack_header(self._fp, h, parent, view)
            wrote = self._io.write_new(self._fd, tmp, (header, view), self.fsync)
            self._io.replace(self._fd, tmp, file_name(h))
        except OSError as exc:
            self._unlink_quietly(tmp)
            self._write_failed(exc)
            with self._lock:
                job.finished = True
                self._reserved -= charge
                self._pending.discard(h)
            return False
        with self._lock:
            job.finished = True
            if not job.abandoned:
                self._reserved -= charge
                self._used += charge
                self._index[h] = DiskEntry(h, parent, view.nbytes, charge)
                self._count["puts_admitted"] += 1
                self._count["bytes_written"] += wrote
                self._pending.discard(h)
                job.admitted, recovered, self._blocked = True, self._blocked, None
        if job.admitted:
            if recovered:
                log.info("disk tier admitting again in %s (was refused: %s)", self.dir, recovered)
            return True
        self._unlink_quietly(file_name(h))  # the caller gave up: keep nothing it was told failed
        with self._lock:
            self._reserved -= charge
            self._pending.discard(h)
        return False

    def _get_job(self, h: bytes) -> bytes | None:
        name = file_name(h)
        try:
            head, payload, st = self._io.read(self._fd, name, HEADER_SIZE, whole=True)
            if not stat.S_ISREG(st.st_mode):
                raise BadFile("unsafe", "not a regular file")
            check_payload(parse_header(head, self._fp, st.st_size, h), payload)
        except FileNotFoundError:
            self._drop(h, "missing", "the file vanished", unlink=False)
            return None
        except BadFile as bad:
            self._drop(h, bad.kind, bad.detail)
            return None
        except OSError as exc:
            self._io_error("read", name, exc)
            self._drop(h, None, "", unlink=True)
            return None
        with self._lock:
            self._count["bytes_read"] += st.st_size
            if h in self._index:
                self._index.move_to_end(h)
        try:
            self._io.touch(self._fd, name)  # recency survives a restart
        except OSError:
            pass
        return payload

    def _unlink_job(self, h: bytes) -> None:
        try:
            self._io.unlink(self._fd, file_name(h), missing_ok=True)
        except OSError as exc:
            self._io_error("unlink", file_name(h), exc)
        finally:
            with self._lock:
                self._pending.discard(h)

    # ---- helpers --------------------------------------------------------------------------------
    def _live(self) -> None:
        if self._closed:
            raise RuntimeError(f"the disk store on {self.dir} is closed")

    def _may_admit(self) -> bool:  # under self._lock
        return (self._blocked is None or time.monotonic() >= self._blocked_until
                or self._used < self._blocked_used)

    def _write_failed(self, exc: OSError) -> None:
        reason = "disk_full" if exc.errno in _FULL else "read_only" if exc.errno in _READ_ONLY else None
        if reason is None:
            self._io_error("write", self.dir, exc)
            return
        with self._lock:
            self._count["admit_refused_disk_full" if reason == "disk_full" else "io_errors"] += 1
            first = self._blocked is None
            self._blocked, self._blocked_used = reason, self._used
            self._blocked_until = time.monotonic() + self.retry_after_s
        (log.warning if first else log.debug)(
            "disk tier stops admitting blocks to %s: %s (%s); metric disk_tier_admitting=0; retrying after "
            "%.0f s or once the tier frees space; requests are unaffected", self.dir, reason, exc.strerror,
            self.retry_after_s)

    def _io_error(self, op: str, what: str, exc: OSError) -> None:
        with self._lock:
            self._count["io_errors"] += 1
        self._warn(f"io-{op}", "disk tier %s error on %s: %s (metric disk_tier_io_errors_total)", op, what, exc)

    def _slow(self, op: str, exc: Exception) -> None:
        kind = "timeouts" if isinstance(exc, IOTimeout) else "busy"
        with self._lock:
            self._count[kind] += 1
        self._warn(kind, "disk tier %s abandoned: %s; counted in disk_tier_%s_total", op,
                   f"slower than {self._runner.timeout_s} s" if kind == "timeouts"
                   else "every I/O worker is stuck on an earlier operation", kind)

    def _drop(self, h: bytes, kind: str | None, detail: str, unlink: bool = True) -> None:
        """Unindex a block whose file must not be served, delete the file, count and log it."""
        with self._lock:
            entry = self._index.pop(h, None)
            if entry is None:
                return  # someone else dropped it already (and may have re-put it: leave the file)
            self._used -= entry.charged_bytes
            self._pending.add(h)
            if kind is not None:
                self._count[f"{kind}_dropped"] += 1
        if kind is not None:
            self._warn(f"drop-{kind}", "disk tier dropped block file %s (%s: %s); metric disk_tier_%s_dropped_total",
                       file_name(h), kind, detail, kind)
        if unlink:
            self._unlink_quietly(file_name(h))
        with self._lock:
            self._pending.discard(h)

    def _unlink_quietly(self, name: str) -> None:
        try:
            self._io.unlink(self._fd, name, missing_ok=True)
        except OSError as exc:
            self._io_error("unlink", name, exc)

    def _warn(self, key: str, msg: str, *args: object) -> None:
        """At most one warning per kind of fault a minute, so a bad disk cannot flood the log."""
        now = time.monotonic()
        with self._lock:
            if now - self._warned.get(key, -1e9) < 60.0:
                return
            self._warned[key] = now
        log.warning(msg, *args)

    def _close_fds(self) -> None:
        os.close(self._fd)  # releases the directory lock

    def _load(self) -> ReindexReport:
        entries, rep = reindex(self._io, self._fd, self.dir, self._fp, self.capacity_bytes, self.charge, _hash_of,
                               TMP_PREFIX)
        for e in entries:
            self._index[e.block_hash] = e
        self._used = rep.bytes
        for kind, n in rep.dropped.items():
            self._count[f"{kind}_dropped"] += n
        self._count["temp_removed"] += rep.temp_removed
        self._count["io_errors"] += rep.io_errors
        try:
            free = os.fstatvfs(self._fd)
            room = free.f_bavail * free.f_frsize + self._used
        except OSError:
            return rep
        if free.f_flag & os.ST_RDONLY:  # serve what is there; admit nothing (retried after the back-off)
            self._blocked, self._blocked_until = "read_only", time.monotonic() + self.retry_after_s
            log.warning("disk tier %s is on a read-only filesystem: serving its %d blocks, admitting none "
                        "(disk_tier_admitting=0)", self.dir, len(self._index))
            return rep
        if room < self.capacity_bytes:
            log.warning("disk_cache_bytes=%d exceeds the %d bytes the filesystem of %s has room for; the disk tier "
                        "stops admitting (disk_tier_admitting=0) when the disk fills", self.capacity_bytes, room,
                        self.dir)
        return rep
