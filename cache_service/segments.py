"""Names of the KV segments in shared memory, and the removal of those a killed cache service left.

A cache service removes its segment when it stops (PoolStorage.close), but a SIGKILLed one never
does: its file in /dev/shm would hold the pool's memory until a reboot. The name carries the
owner's pid (`nanokv-kv-<pid>-<random>`), so a cache service removes at start every segment whose
owner is gone. A compute service that still maps one keeps its pages until it drops the mapping
(cache_watch), which it does as soon as it notices the owner died. No torch here.
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid

log = logging.getLogger("nanokv.cache_service")

PREFIX = "nanokv-kv-"


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def new_segment_path() -> str:
    return os.path.join(shm_dir(), f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")


def owner_pid(name: str) -> int | None:
    if not name.startswith(PREFIX):
        return None
    pid, _, rest = name[len(PREFIX):].partition("-")
    return int(pid) if pid.isdigit() and rest else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_orphans() -> list[str]:
    """Remove the segments whose cache service is no longer running (or had this process's pid:
    a container's cache service restarts with the same one); returns their paths."""
    removed: list[str] = []
    d = shm_dir()
    try:
        names = os.listdir(d)
    except OSError:
        return removed
    for name in names:
        pid = owner_pid(name)
        if pid is None or (pid != os.getpid() and _alive(pid)):
            continue
        path = os.path.join(d, name)
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    if removed:
        log.warning("removed %d KV segment(s) left by a cache service that is gone: %s", len(removed),
                    ", ".join(removed))
    return removed
