"""L3 of the KV cache hierarchy: a directory of block files under a byte budget (``disk_cache_dir``,
``disk_cache_bytes``). One file per block, named by its salted chained hash (cache_service/hashing.py),
so a tenant only ever finds blocks of its own salt. Pure Python: a payload is opaque bytes.

What is verified when (the file layout: disk_format.py):
  start-up  each file's 184-byte header (disk_reindex.py); payload checksums are not read, since
            that would read the whole tier (up to a disk's worth at disk speed) before start.
  get       header and payload checksum; a bad file is deleted, counted, logged and reported as
            a miss, so nothing unverified is ever served.
A write goes to a temp file (O_EXCL, 0o600) renamed over the final name: a crash leaves no file or
a whole one. Faults never raise out of put/get (disk_health.py): a full or read-only disk stops
admission until ``retry_after_s`` passes or the tier frees space; a stalled disk is cut off after
``timeout_s`` (disk_io.BoundedRunner) and counted as a miss.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
from collections import OrderedDict
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
from nanokv.cache_service.tiers.disk_health import DiskHealth, log
from nanokv.cache_service.tiers.disk_io import BoundedRunner, DiskIO, IOBusy, IOTimeout, open_cache_dir
from nanokv.cache_service.tiers.disk_reindex import DiskEntry, ReindexReport, reindex
from nanokv.errors import ConfigError, NanoKVError

SUFFIX, TMP_PREFIX = ".kvb", ".tmp-"


def file_name(block_hash: bytes) -> str:
    return block_hash.hex() + SUFFIX


def hash_of(name: str) -> bytes | None:
    stem = name[:-len(SUFFIX)]
    if not name.endswith(SUFFIX) or len(stem) != 2 * HASH_BYTES:
        return None
    try:
        h = bytes.fromhex(stem)
    except ValueError:
        return None
    return h if h.hex() == stem else None  # lower-case hex only: one name per block


def _check_hash(field: str, value: object) -> None:
    if not isinstance(value, bytes) or len(value) != HASH_BYTES:
        got = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise NanoKVError(field, f"must be a {HASH_BYTES}-byte block hash (cache_service/hashing.py), got {got}")


def _byte_parts(payload: object) -> list[memoryview]:
    """A payload (one buffer, or a list or tuple of them) as flat byte views, no copy."""
    out = []
    for part in payload if isinstance(payload, (list, tuple)) else (payload,):
        view = memoryview(part)  # any buffer-protocol object
        if view.ndim != 1 or view.format not in ("B", "b", "c"):
            view = view.cast("B")
        out.append(view)
    return out


class _PutJob:
    """A write's hand-off between the caller and its worker (both under the store's lock)."""

    __slots__ = ("abandoned", "finished", "admitted")

    def __init__(self) -> None:
        self.abandoned = self.finished = self.admitted = False


class DiskStore:
    """A byte-budgeted directory of verified KV block files; thread-safe; one store per directory
    (a lock on it refuses a second). ``keys()`` lists least recently used first (puts and hits; after
    a restart by file mtime, which a hit refreshes) for a caller that evicts; ``evict_for`` does it."""

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
        self.health = DiskHealth(dir, retry_after_s)
        self._fp = fingerprint_digest(fingerprint)
        self._io = io or DiskIO()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, DiskEntry] = OrderedDict()  # least recently used first
        self._pending: set[bytes] = set()  # blocks with a write or delete in flight
        self._used = self._reserved = 0  # charged bytes on disk / of writes in flight
        self._closed = False
        self._fd = open_cache_dir(dir)
        try:
            self._fs_block = os.fstatvfs(self._fd).f_frsize or 4096
            self.reindex_report = self._load()
        except BaseException:
            os.close(self._fd)
            raise
        self._runner = BoundedRunner(timeout_s, io_workers)

    def put(self, block_hash: bytes, payload: object, parent_hash: bytes | None = None) -> bool:
        """Store a block: ``payload`` is any buffer, or a list or tuple of buffers written one after
        the other (a host slot's tensors, read where they lie: no joined copy). True once it is on
        disk under its name (or already was). False, never an
        exception, when it is not admitted: the budget is full (evict first), the disk is full or
        read-only, the write failed or outran ``timeout_s``."""
        _check_hash("block_hash", block_hash)
        if parent_hash is not None:
            _check_hash("parent_hash", parent_hash)
        parts = _byte_parts(payload)
        nbytes = sum(p.nbytes for p in parts)
        charge = self.charge(nbytes)
        self.health.add("puts")
        with self._lock:
            self._live()
            if block_hash in self._index:
                return True  # content-addressed: same salted chained hash and fingerprint, same KV
            refused = ("busy" if block_hash in self._pending
                       else "admit_refused_unavailable" if not self.health.may_admit(self._used)
                       else "admit_refused_full" if self._used + self._reserved + charge > self.capacity_bytes
                       else None)
            if refused is None:
                self._reserved += charge
                self._pending.add(block_hash)
        if refused is not None:
            self.health.add(refused)
            return False
        job = _PutJob()
        try:
            return self._runner.run(self._put_job, job, block_hash, parent_hash, parts, charge)
        except (IOTimeout, IOBusy) as exc:
            with self._lock:
                if job.finished:
                    return job.admitted
                job.abandoned = True  # the worker takes its file back when it finishes
                if isinstance(exc, IOBusy):  # never started
                    self._reserved -= charge
                    self._pending.discard(block_hash)
            self.health.slow("put", isinstance(exc, IOTimeout), self._runner.timeout_s)
            return False

    def get(self, block_hash: bytes) -> bytes | None:
        """The payload, verified against its header and checksum; None on a miss, a bad file (deleted,
        counted, logged), an I/O error or a read slower than ``timeout_s``."""
        with self._lock:
            self._live()
            known = block_hash in self._index
        self.health.add("gets")
        data = None
        if known:
            try:
                data = self._runner.run(self._get_job, block_hash)
            except (IOTimeout, IOBusy) as exc:
                self.health.slow("get", isinstance(exc, IOTimeout), self._runner.timeout_s)
        self.health.add("hits" if data is not None else "misses")
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
        except IOBusy:
            with self._lock:  # nothing ran: the block stays, as the oldest
                self._index[block_hash] = entry
                self._index.move_to_end(block_hash, last=False)
                self._used += entry.charged_bytes
                self._pending.discard(block_hash)
            self.health.slow("remove", False, self._runner.timeout_s)
            return False
        except IOTimeout:
            self.health.slow("remove", True, self._runner.timeout_s)  # the worker finishes the unlink
        return True

    def evict_for(self, payload_bytes: int) -> list[bytes]:
        """Remove least recently used blocks until a payload of this size fits the budget; returns
        the removed hashes (a tier policy may instead evict in its own order with ``remove``)."""
        need = self.charge(payload_bytes)
        out: list[bytes] = []
        while need <= self.capacity_bytes:
            with self._lock:
                if self._used + self._reserved + need <= self.capacity_bytes or not self._index:
                    break
                victim = next(iter(self._index))
            if not self.remove(victim):
                break
            out.append(victim)
            self.health.add("evicted")
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
        """Budget bytes one block of this payload size costs: header included, rounded up to the
        filesystem's block, since that is what the disk gives up for it."""
        return -(-(HEADER_SIZE + payload_bytes) // self._fs_block) * self._fs_block

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def admitting(self) -> bool:
        """False while a full or read-only disk holds admission back (until a retry is due)."""
        return self.health.may_admit(self._used)

    @property
    def admit_reason(self) -> str:
        """"ok", or why the disk refused the last write ("disk_full", "read_only") until one succeeds."""
        return self.health.reason or "ok"

    def stats(self) -> dict[str, int]:
        """Counters (``disk_tier_*_total``) and gauges, named for the cache service's metrics."""
        out = self.health.counters()
        out.update(disk_tier_used_bytes=self._used, disk_tier_capacity_bytes=self.capacity_bytes,
                   disk_tier_blocks=len(self._index), disk_tier_admitting=int(self.admitting))
        return out

    def close(self) -> None:
        """Stop; the directory (and its lock) is released once any stalled worker has finished."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._runner.close(lambda: os.close(self._fd))

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- workers: run on the runner's threads (inline without a timeout), do their own accounting
    def _put_job(self, job: _PutJob, h: bytes, parent: bytes | None, parts: list[memoryview], charge: int) -> bool:
        tmp = f"{TMP_PREFIX}{h.hex()}-{secrets.token_hex(4)}"
        try:
            header = pack_header(self._fp, h, parent, parts)
            wrote = self._io.write_new(self._fd, tmp, [memoryview(header), *parts], self.fsync)
            self._io.replace(self._fd, tmp, file_name(h))
        except OSError as exc:
            self._unlink_quietly(tmp)
            self.health.write_failed(exc, self._used)
            wrote = -1
        with self._lock:
            job.finished = True
            job.admitted = wrote >= 0 and not job.abandoned
            if wrote < 0 or job.admitted:
                self._reserved -= charge
                self._pending.discard(h)
            if job.admitted:
                self._used += charge
                self._index[h] = DiskEntry(h, parent, sum(p.nbytes for p in parts), charge)
        if job.admitted:
            self.health.add("puts_admitted")
            self.health.add("bytes_written", wrote)
            self.health.write_ok()
        elif wrote >= 0:  # written, but the caller gave up waiting: keep nothing it was told failed
            self._unlink_quietly(file_name(h))
            with self._lock:
                self._reserved -= charge
                self._pending.discard(h)
        return job.admitted

    def _get_job(self, h: bytes) -> bytes | None:
        name = file_name(h)
        try:
            head, payload, st = self._io.read(self._fd, name, HEADER_SIZE, whole=True)
            if not stat.S_ISREG(st.st_mode):
                raise BadFile("unsafe", "not a regular file")
            check_payload(parse_header(head, self._fp, st.st_size, h), payload)
        except FileNotFoundError:
            self._drop(h, "missing", "the file vanished")
            return None
        except BadFile as bad:
            self._drop(h, bad.kind, bad.detail)
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
                self._drop(h, "unsafe", "a symbolic link")
                return None
            self.health.io_error("read", name, exc)
            self._drop(h, None, "")
            return None
        self.health.add("bytes_read", st.st_size)
        with self._lock:
            if h in self._index:
                self._index.move_to_end(h)
        try:
            self._io.touch(self._fd, name)  # recency survives a restart
        except OSError:
            pass
        return payload

    def _unlink_job(self, h: bytes) -> None:
        try:
            self._unlink_quietly(file_name(h))
        finally:
            with self._lock:
                self._pending.discard(h)

    def _drop(self, h: bytes, kind: str | None, detail: str) -> None:
        """Unindex a block whose file must not be served, delete the file, count and log it."""
        with self._lock:
            entry = self._index.pop(h, None)
            if entry is None:
                return  # dropped by another thread already (and maybe put again: leave the file)
            self._used -= entry.charged_bytes
            self._pending.add(h)
        if kind is not None:
            self.health.dropped(kind, file_name(h), detail)
        self._unlink_job(h)

    def _unlink_quietly(self, name: str) -> None:
        try:
            self._io.unlink(self._fd, name, missing_ok=True)
        except OSError as exc:
            self.health.io_error("unlink", name, exc)

    def _live(self) -> None:
        if self._closed:
            raise RuntimeError(f"the disk store on {self.dir} is closed")

    def _load(self) -> ReindexReport:
        entries, rep = reindex(self._io, self._fd, self.dir, self._fp, self.capacity_bytes, self.charge, hash_of,
                               TMP_PREFIX)
        self._index.update((e.block_hash, e) for e in entries)
        self._used = rep.bytes
        for kind, n in rep.dropped.items():
            self.health.add(f"{kind}_dropped", n)
        self.health.add("temp_removed", rep.temp_removed)
        self.health.add("io_errors", rep.io_errors)
        fs = os.fstatvfs(self._fd)
        if fs.f_flag & os.ST_RDONLY:  # serve what is there, admit nothing (a write is retried later)
            self.health.stop("read_only", self._used, "read-only filesystem; its blocks are still served")
        elif fs.f_bavail * fs.f_frsize + self._used < self.capacity_bytes:
            log.warning("disk_cache_bytes=%d exceeds the %d bytes the filesystem of %s has room for; the disk "
                        "tier stops admitting (disk_tier_admitting=0) when the disk fills", self.capacity_bytes,
                        fs.f_bavail * fs.f_frsize + self._used, self.dir)
        return rep
