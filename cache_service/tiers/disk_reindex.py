"""The disk tier's start-up scan: index every valid block file by its hash again, from headers only.

A header is 184 bytes, so the scan costs one open + pread per file however large the tier is;
payload checksums wait for each block's first get (disk_store.py says why). What cannot be used
is deleted here, counted by kind in the report: another model's or format version's files
(foreign), damaged headers and names (corrupt), cut-short files (truncated), links and files of
another owner (unsafe), and, oldest first, whatever exceeds the byte budget (over_budget).
Files that do not look like ours at all are left alone: the directory may be shared by mistake.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import time
from collections.abc import Callable

from nanokv.cache_service.tiers.disk_format import HEADER_SIZE, BadFile, parse_header
from nanokv.cache_service.tiers.disk_io import DiskIO

log = logging.getLogger("nanokv.cache_service.disk")


@dataclasses.dataclass(frozen=True)
class DiskEntry:
    block_hash: bytes
    parent_hash: bytes | None
    payload_bytes: int
    charged_bytes: int  # header + payload rounded up to the filesystem block: what the budget counts


@dataclasses.dataclass
class ReindexReport:
    blocks: int = 0  # indexed
    bytes: int = 0  # their charged bytes
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)  # kind -> files deleted
    temp_removed: int = 0  # leftovers of writes a crash interrupted
    unknown_ignored: int = 0  # files not ours, left in place
    io_errors: int = 0
    seconds: float = 0.0


def reindex(io: DiskIO, dir_fd: int, dir: str, fp_digest: bytes, capacity: int, charge: Callable[[int], int],
            hash_of: Callable[[str], bytes | None], tmp_prefix: str) -> tuple[list[DiskEntry], ReindexReport]:
    """The valid blocks of the directory, least recently used (oldest mtime) first, within budget."""
    t0 = time.perf_counter()
    rep = ReindexReport()
    found: list[tuple[int, str, DiskEntry]] = []
    unknown: list[str] = []

    def drop(name: str, kind: str, detail: str) -> None:
        rep.dropped[kind] = rep.dropped.get(kind, 0) + 1
        log.debug("disk tier re-index drops %s (%s: %s)", name, kind, detail)
        try:
            io.unlink(dir_fd, name, missing_ok=True)
        except OSError as exc:
            rep.io_errors += 1
            log.warning("disk tier cannot delete %s in %s: %s", name, dir, exc)

    for name, st in io.scan(dir_fd):
        if name.startswith(tmp_prefix):
            # the directory lock is ours, so no live writer owns this: a crash cut its write short
            try:
                io.unlink(dir_fd, name, missing_ok=True)
                rep.temp_removed += 1
            except OSError as exc:
                rep.io_errors += 1
                log.warning("disk tier cannot delete %s in %s: %s", name, dir, exc)
            continue
        h = hash_of(name)
        if h is None:
            unknown.append(name)
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            drop(name, "unsafe", "not a regular file of ours")
            continue
        try:
            head, _, st = io.read(dir_fd, name, HEADER_SIZE, whole=False)
            if not stat.S_ISREG(st.st_mode):
                raise BadFile("unsafe", "not a regular file")
            header = parse_header(head, fp_digest, st.st_size, h)
        except BadFile as bad:
            drop(name, bad.kind, bad.detail)
            continue
        except OSError as exc:
            rep.io_errors += 1
            log.warning("disk tier cannot read %s in %s: %s; not indexed", name, dir, exc)
            continue
        entry = DiskEntry(h, header.parent_hash, header.payload_len, charge(header.payload_len))
        found.append((st.st_mtime_ns, name, entry))

    found.sort(key=lambda f: (f[0], f[1]))
    total = sum(e.charged_bytes for _, _, e in found)
    first = 0
    while total > capacity:  # the budget shrank since the files were written: the oldest go
        _, name, entry = found[first]
        drop(name, "over_budget", f"beyond disk_cache_bytes={capacity}")
        total -= entry.charged_bytes
        first += 1
    entries = [e for _, _, e in found[first:]]
    rep.blocks, rep.bytes = len(entries), total
    rep.unknown_ignored = len(unknown)
    rep.seconds = time.perf_counter() - t0
    if unknown:
        log.warning("disk tier leaves %d file(s) in %s that are not block files alone (e.g. %s); they are "
                    "neither counted in disk_cache_bytes nor deleted", len(unknown), dir, ", ".join(unknown[:3]))
    log.info("disk tier re-indexed %s: %d blocks, %d bytes in %.3f s; dropped %s; %d temp file(s) removed",
             dir, rep.blocks, rep.bytes, rep.seconds, rep.dropped or "nothing", rep.temp_removed)
    return entries, rep
