"""The disk tier's health: its counters (exported as ``disk_tier_*``), whether it admits new blocks,
and its log lines. A fault never raises out of the store; it shows here three ways: a status
(``admitting`` / ``reason``), a counter, and a warning (one when admission stops, then at most one a
minute per kind of fault, so a failing disk cannot flood the log).
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import Counter

log = logging.getLogger("nanokv.cache_service.disk")

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
READ_ONLY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
DROP_KINDS = ("corrupt", "foreign", "truncated", "unsafe", "missing", "over_budget")
COUNTERS = ("puts", "puts_admitted", "gets", "hits", "misses", "evicted", "temp_removed", "io_errors",
            "timeouts", "busy", "admit_refused_full", "admit_refused_disk_full", "admit_refused_unavailable",
            "bytes_written", "bytes_read") + tuple(f"{k}_dropped" for k in DROP_KINDS)
WARN_EVERY_S = 60.0


class DiskHealth:
    def __init__(self, dir: str, retry_after_s: float):
        self.dir, self.retry_after_s = dir, retry_after_s
        self._lock = threading.Lock()
        self._count: Counter[str] = Counter()
        self.reason: str | None = None  # why the disk refused the last write: disk_full / read_only
        self._until = 0.0  # monotonic time after which a write is tried again
        self._used_then = 0  # the tier's used bytes when it stopped: freeing any allows a retry
        self._warned: dict[str, float] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._count[name] += n

    def may_admit(self, used: int) -> bool:
        """True unless the disk refused a write and neither the back-off passed nor space was freed."""
        return self.reason is None or time.monotonic() >= self._until or used < self._used_then

    def stop(self, reason: str, used: int, detail: str) -> None:
        with self._lock:
            first = self.reason is None
            self.reason, self._used_then = reason, used
            self._until = time.monotonic() + self.retry_after_s
        (log.warning if first else log.debug)(
            "disk tier stops admitting blocks to %s: %s (%s); metric disk_tier_admitting=0; retrying after "
            "%.0f s or once the tier frees space; requests are unaffected", self.dir, reason, detail,
            self.retry_after_s)

    def write_failed(self, exc: OSError, used: int) -> None:
        if exc.errno in FULL_ERRNOS:
            self.add("admit_refused_disk_full")
            self.stop("disk_full", used, exc.strerror or str(exc))
        elif exc.errno in READ_ONLY_ERRNOS:
            self.add("io_errors")
            self.stop("read_only", used, exc.strerror or str(exc))
        else:  # EIO and the like: counted and logged; the next write tries again
            self.io_error("write", self.dir, exc)

    def write_ok(self) -> None:
        if self.reason is None:
            return
        with self._lock:
            was, self.reason = self.reason, None
        if was is not None:
            log.info("disk tier admitting again in %s (was refused: %s)", self.dir, was)

    def io_error(self, op: str, what: str, exc: OSError) -> None:
        self.add("io_errors")
        self.warn(f"io-{op}", "disk tier %s error on %s: %s (metric disk_tier_io_errors_total)", op, what, exc)

    def slow(self, op: str, timed_out: bool, timeout_s: float | None) -> None:
        kind = "timeouts" if timed_out else "busy"
        self.add(kind)
        self.warn(kind, "disk tier %s abandoned: %s; counted in disk_tier_%s_total (a miss for a get, a "
                        "refusal for a put)", op, f"slower than {timeout_s} s" if timed_out
                  else "every I/O worker is stuck on an earlier operation", kind)

    def dropped(self, kind: str, name: str, detail: str) -> None:
        self.add(f"{kind}_dropped")
        self.warn(f"drop-{kind}", "disk tier dropped block file %s (%s: %s); metric disk_tier_%s_dropped_total",
                  name, kind, detail, kind)

    def warn(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._warned.get(key, -1e9) < WARN_EVERY_S:
                return
            self._warned[key] = now
        log.warning(msg, *args)

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {f"disk_tier_{k}_total": self._count[k] for k in COUNTERS}
