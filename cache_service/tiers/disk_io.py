"""The disk tier's I/O: opening the directory safely, the file operations (all relative to one
directory descriptor, so the directory cannot be swapped for a symlink after it was checked), and
a bounded runner that gives each operation a deadline.

``DiskIO`` is the one seam for fault injection: the tests subclass it to raise a real
``OSError(ENOSPC)`` or to stall, exactly as a failing or slow disk would.
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import logging
import os
import stat
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from nanokv.errors import ConfigError

T = TypeVar("T")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
log = logging.getLogger("nanokv.cache_service.disk")


def open_cache_dir(path: str) -> int:
    """Create (0o700) or open ``path``; return its fd, locked. Refuses a symlink, a
    directory owned by another user or writable by group/others, and one another store holds."""
    if not path:
        raise ConfigError("disk_cache_dir", "is empty; give a directory path (the disk tier is off without one)")
    try:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):  # Linux says ENOTDIR
            raise ConfigError("disk_cache_dir", f"{path} is a symlink; give the real directory") from exc
        if exc.errno == errno.ENOTDIR:
            raise ConfigError("disk_cache_dir", f"{path} is not a directory") from exc
        raise ConfigError("disk_cache_dir", f"cannot open {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise ConfigError("disk_cache_dir", f"{path} is owned by uid {st.st_uid}, not by this process "
                                                f"(uid {os.geteuid()}); use a directory of our own")
        if st.st_mode & 0o022:
            raise ConfigError("disk_cache_dir", f"{path} is writable by group or others (mode "
                                                f"{stat.S_IMODE(st.st_mode):o}); chmod it to 700")
    except BaseException:
        os.close(fd)
        raise
    try:
        # the lock is on the directory itself (no lock file), so a read-only disk can still be opened
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise ConfigError("disk_cache_dir", f"{path} is in use by another disk store (its directory lock is "
                                            "held); give each cache service its own directory") from exc
    except OSError as exc:  # a filesystem without locks: go on, the operator was told
        log.warning("cannot lock disk_cache_dir %s (%s); make sure no other cache service uses it", path, exc)
    return fd


class DiskIO:
    """File operations of one block file each; every name is relative to ``dir_fd``."""

    def write_new(self, dir_fd: int, name: str, parts: Sequence[bytes | memoryview], fsync: bool) -> int:
        """Create ``name`` (O_EXCL, mode 0o600) holding ``parts``; on any error nothing is left."""
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dir_fd)
        total = 0
        try:
            for part in parts:
                view = memoryview(part)
                while view.nbytes:  # os.write may write less than asked (a nearly full disk does)
                    n = os.write(fd, view)
                    total += n
                    view = view[n:]
            if fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            self.unlink(dir_fd, name, missing_ok=True)
            raise
        os.close(fd)
        return total

    def replace(self, dir_fd: int, src: str, dst: str) -> None:
        os.replace(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    def read(self, dir_fd: int, name: str, head: int, whole: bool) -> tuple[bytes, bytes, os.stat_result]:
        """The first ``head`` bytes, the rest of the file (only when ``whole``) and its stat."""
        # O_NONBLOCK: a FIFO planted under a block's name must not block the open
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return b"", b"", st  # the caller rejects it by its mode
            first = _pread(fd, min(head, st.st_size), 0)
            rest = _pread(fd, st.st_size - len(first), len(first)) if whole else b""
            return first, rest, st
        finally:
            os.close(fd)

    def unlink(self, dir_fd: int, name: str, missing_ok: bool = False) -> None:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def touch(self, dir_fd: int, name: str) -> None:
        """Mark a block used now: the re-index after a restart orders blocks by mtime."""
        os.utime(name, dir_fd=dir_fd, follow_symlinks=False)

    def scan(self, dir_fd: int) -> list[tuple[str, os.stat_result]]:
        out = []
        with os.scandir(dir_fd) as it:
            for entry in it:
                try:
                    out.append((entry.name, entry.stat(follow_symlinks=False)))
                except FileNotFoundError:
                    continue
        return out


def _pread(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) == n or not data:
        return data
    chunks = [data]  # a short read (huge file, signal): keep going until EOF or n bytes
    got = len(data)
    while got < n:
        more = os.pread(fd, n - got, offset + got)
        if not more:
            break
        chunks.append(more)
        got += len(more)
    return b"".join(chunks)


class IOTimeout(Exception):
    """The operation did not finish within the deadline; it keeps running on its worker thread."""


class IOBusy(Exception):
    """Every worker is still busy with earlier (stalled) operations; nothing was started."""


class BoundedRunner:
    """Runs I/O on a few worker threads and waits at most ``timeout_s`` for each result.

    A stalled disk blocks a read in the kernel where it cannot be cancelled, so the caller gives
    up and the worker finishes (or hangs) alone. New work is refused once every worker is taken
    rather than queued, so a dead disk costs each caller at most ``timeout_s``, never a hang, and
    never an unbounded queue. ``timeout_s=None``: run inline on the caller's thread.
    """

    def __init__(self, timeout_s: float | None, workers: int):
        self.timeout_s = timeout_s
        self._pool = (concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="nanokv-disk")
                      if timeout_s is not None else None)
        self._lock = threading.Lock()
        self._workers = self._free = workers
        self._on_idle: Callable[[], None] | None = None

    def run(self, fn: Callable[..., T], *args: object) -> T:
        if self._pool is None:
            return fn(*args)
        with self._lock:
            if self._free == 0:
                raise IOBusy()
            self._free -= 1
        try:
            future = self._pool.submit(self._job, fn, args)
        except BaseException:
            self._release()
            raise
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError as exc:
            raise IOTimeout() from exc

    def _job(self, fn: Callable[..., T], args: tuple[object, ...]) -> T:
        try:
            return fn(*args)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self._free += 1
            idle = self._on_idle if self._free == self._workers else None
        if idle is not None:
            idle()

    def close(self, on_idle: Callable[[], None]) -> None:
        """Stop taking work; call ``on_idle`` now if nothing runs, else when the last job ends."""
        if self._pool is None:
            on_idle()
            return
        self._pool.shutdown(wait=False)  # nothing queues (run refuses when every worker is busy)
        with self._lock:
            busy = self._free != self._workers
            if busy:
                self._on_idle = on_idle
        if not busy:
            on_idle()
