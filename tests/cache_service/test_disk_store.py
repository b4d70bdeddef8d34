"""The disk tier's block store (cache_service/tiers/disk_store.py) on real files: round trip,
restart (same process and separate processes), corrupt / truncated / foreign files dropped and never
served, permissions, the byte budget, a full disk (a real 1 MiB tmpfs where mounting works, and an
injected ENOSPC from the store's I/O seam), a stalled disk, and tenant isolation by salted hashes."""

from __future__ import annotations

import array
import errno
import logging
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from nanokv.cache_service.hashing import hash_full_blocks
from nanokv.cache_service.tiers.disk_format import HEADER_SIZE
from nanokv.cache_service.tiers.disk_io import DiskIO
from nanokv.cache_service.tiers.disk_store import DiskStore, file_name
from nanokv.errors import ConfigError, NanoKVError

FP = "smollm2-135m|bf16|block16"
LOG = "nanokv.cache_service.disk"
TOKENS = list(range(1000, 1064))  # 4 blocks of 16 real-looking token ids


def blocks(salt: str | None = None, tokens: list[int] = TOKENS) -> list[bytes]:
    return hash_full_blocks(tokens, 16, cache_salt=salt)


def payload(i: int, n: int = 5000) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))


def fill(store: DiskStore, hashes: list[bytes], n: int = 5000) -> None:
    parent = None
    for i, h in enumerate(hashes):
        assert store.put(h, payload(i, n), parent)
        parent = h


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG and r.levelno == logging.WARNING
            and text in r.getMessage()]


def test_round_trip(tmp_path):
    hs = blocks()
    with DiskStore(str(tmp_path / "l3"), 1 << 20, FP) as s:
        fill(s, hs)
        floats = array.array("f", [0.5] * 300)  # any buffer-protocol object is a payload
        other = blocks("other")[0]
        assert s.put(other, floats, None)
        assert s.put(hs[0], b"ignored: already stored", None)  # content-addressed: no rewrite
        for i, h in enumerate(hs):
            assert s.contains(h) and s.get(h) == payload(i)
        assert s.get(other) == floats.tobytes()
        assert s.get(blocks("nobody")[0]) is None
        assert [e.parent_hash for e in s.entries()][:4] == [None, hs[0], hs[1], hs[2]]
        st = s.stats()
        assert st["disk_tier_puts_admitted_total"] == 5 and st["disk_tier_hits_total"] == 5
        assert st["disk_tier_misses_total"] == 1 and st["disk_tier_blocks"] == 5
        assert st["disk_tier_bytes_written_total"] == 4 * (HEADER_SIZE + 5000) + HEADER_SIZE + 1200
        assert st["disk_tier_used_bytes"] == s.used_bytes == sum(e.charged_bytes for e in s.entries())


def test_restart_same_process_keeps_bytes_and_recency(tmp_path):
    hs = blocks()
    d = str(tmp_path / "l3")
    with DiskStore(d, 1 << 20, FP) as s:
        fill(s, hs)
        time.sleep(0.02)
        assert s.get(hs[0]) == payload(0)  # a hit refreshes the file's mtime: most recent now
    with DiskStore(d, 1 << 20, FP) as s:
        assert s.reindex_report.blocks == 4 and not s.reindex_report.dropped
        assert s.keys()[-1] == hs[0] and set(s.keys()) == set(hs)
        assert [s.get(h) for h in hs] == [payload(i) for i in range(4)]
        assert {e.block_hash: e.parent_hash for e in s.entries()} == dict(zip(hs, [None] + hs[:3]))


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=os.environ.copy())


def test_restart_across_processes_and_crash_mid_write(tmp_path):
    d = str(tmp_path / "l3")
    writer = _python(f"""
        from nanokv.cache_service.hashing import hash_full_blocks
        from nanokv.cache_service.tiers.disk_io import DiskIO
        from nanokv.cache_service.tiers.disk_store import DiskStore
        import os
        hs = hash_full_blocks({TOKENS!r}, 16, cache_salt="tenant-a")
        s = DiskStore({d!r}, 1 << 20, {FP!r})
        for i, h in enumerate(hs[:3]):
            assert s.put(h, bytes([i]) * 4096, None)
        s.close()

        class Crash(DiskIO):  # the process dies after writing the temp file, before the rename
            def replace(self, dir_fd, src, dst):
                os._exit(3)
        s = DiskStore({d!r}, 1 << 20, {FP!r}, io=Crash())
        s.put(hs[3], b"never visible" * 100, None)
    """)
    assert writer.returncode == 3, writer.stderr
    assert any(n.startswith(".tmp-") for n in os.listdir(d))  # the crash left its temp file
    reader = _python(f"""
        from nanokv.cache_service.hashing import hash_full_blocks
        from nanokv.cache_service.tiers.disk_store import DiskStore
        hs = hash_full_blocks({TOKENS!r}, 16, cache_salt="tenant-a")
        with DiskStore({d!r}, 1 << 20, {FP!r}) as s:
            r = s.reindex_report
            print(r.blocks, r.temp_removed, [(s.get(h) or b"")[:2].hex() for h in hs])
    """)
    assert reader.returncode == 0, reader.stderr
    assert reader.stdout.split("\n")[-2] == "3 1 ['0000', '0101', '0202', '']"
    assert not any(n.startswith(".tmp-") for n in os.listdir(d))


def test_corrupt_payload_is_dropped_never_served(tmp_path, caplog):
    hs = blocks()
    d = tmp_path / "l3"
    with DiskStore(str(d), 1 << 20, FP) as s:
        fill(s, hs)
        path = d / file_name(hs[1])
        raw = bytearray(path.read_bytes())
        raw[HEADER_SIZE + 1234] ^= 0x01  # one bit of the payload
        path.write_bytes(raw)
        assert s.contains(hs[1])
        assert s.get(hs[1]) is None and not path.exists() and not s.contains(hs[1])
        assert s.get(hs[1]) is None  # stays a miss; nothing else is touched
        assert s.get(hs[2]) == payload(2)
        assert s.stats()["disk_tier_corrupt_dropped_total"] == 1
        assert warnings_of(caplog, "payload checksum mismatch")


def test_corrupt_header_truncated_and_foreign_files_dropped_at_reindex(tmp_path):
    hs = blocks(tokens=list(range(1000, 1080)))  # 5 blocks
    d = tmp_path / "l3"
    with DiskStore(str(d), 1 << 20, FP) as s:
        fill(s, hs)
    p0, p1, p2, _, p4 = (d / file_name(h) for h in hs)
    raw = bytearray(p0.read_bytes())
    raw[60] ^= 0xFF  # inside the block-hash field: the header digest fails
    p0.write_bytes(raw)
    p1.write_bytes(p1.read_bytes()[:HEADER_SIZE + 100])  # cut short
    p2.write_bytes(p2.read_bytes()[:50])  # cut inside the header
    raw = bytearray(p4.read_bytes())
    raw[8] = 2  # format version 2: another release's layout
    p4.write_bytes(raw)
    (d / "notes.txt").write_text("not ours")
    outside = tmp_path / "outside"
    outside.write_bytes(b"x" * 300)
    (d / file_name(blocks("link")[0])).symlink_to(outside)  # a link named like a block
    with DiskStore(str(d), 1 << 20, FP) as s:
        assert s.reindex_report.dropped == {"corrupt": 1, "truncated": 2, "foreign": 1, "unsafe": 1}
        assert s.keys() == [hs[3]] and s.get(hs[3]) == payload(3)
        assert s.reindex_report.unknown_ignored == 1 and (d / "notes.txt").exists()  # never delete others'
        assert outside.read_bytes() == b"x" * 300  # the link went, not its target
        st = s.stats()
        assert st["disk_tier_corrupt_dropped_total"] == 1 and st["disk_tier_truncated_dropped_total"] == 2
    with DiskStore(str(d), 1 << 20, "another-model|fp8|block16") as s:  # same dir, another model
        assert s.reindex_report.dropped == {"foreign": 1} and len(s) == 0
        assert s.get(hs[3]) is None and s.stats()["disk_tier_foreign_dropped_total"] == 1
    assert os.listdir(d) == ["notes.txt"]


def test_store_imports_no_torch():
    r = _python("""
        import sys
        import nanokv.cache_service.tiers.disk_store
        print("torch" in sys.modules)
    """)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_truncated_vanished_and_unsafe_files_dropped_on_get(tmp_path):
    hs = blocks()
    d = tmp_path / "l3"
    with DiskStore(str(d), 1 << 20, FP) as s:
        fill(s, hs)
        os.truncate(d / file_name(hs[0]), HEADER_SIZE + 10)
        os.unlink(d / file_name(hs[1]))
        os.unlink(d / file_name(hs[2]))
        os.mkfifo(d / file_name(hs[2]))  # a FIFO must not block the read
        (d / file_name(hs[3])).unlink()
        (d / file_name(hs[3])).symlink_to(d / file_name(hs[2]))
        assert [s.get(h) for h in hs] == [None] * 4
        st = s.stats()
        assert st["disk_tier_truncated_dropped_total"] == 1 and st["disk_tier_missing_dropped_total"] == 1
        assert st["disk_tier_unsafe_dropped_total"] == 2 and st["disk_tier_misses_total"] == 4
        assert len(s) == 0 and s.used_bytes == 0 and os.listdir(d) == []


def test_permissions_and_directory_checks(tmp_path):
    d = tmp_path / "a" / "l3"
    with DiskStore(str(d), 1 << 20, FP) as s:
        assert s.put(blocks()[0], b"x" * 100)
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        for name in os.listdir(d):
            assert stat.S_IMODE(os.stat(d / name).st_mode) == 0o600, name
        with pytest.raises(ConfigError, match="disk_cache_dir: .* in use by another disk store"):
            DiskStore(str(d), 1 << 20, FP)
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(ConfigError, match="disk_cache_dir: .* is a symlink"):
        DiskStore(str(link), 1 << 20, FP)
    os.chmod(d, 0o770)
    with pytest.raises(ConfigError, match="disk_cache_dir: .* writable by group or others"):
        DiskStore(str(d), 1 << 20, FP)
    os.chmod(d, 0o700)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="disk_cache_dir: .* not a directory"):
        DiskStore(str(tmp_path / "file"), 1 << 20, FP)
    if os.geteuid() == 0:  # only root can hand a directory to another user
        os.chown(d, 65534, 65534)
        with pytest.raises(ConfigError, match="disk_cache_dir: .* owned by uid 65534"):
            DiskStore(str(d), 1 << 20, FP)


def test_bad_arguments_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="disk_cache_bytes"):
        DiskStore(str(tmp_path / "x"), -1, FP)
    with pytest.raises(ConfigError, match="disk_cache_dir"):
        DiskStore("", 1, FP)
    with DiskStore(str(tmp_path / "l3"), 1 << 20, FP) as s:
        with pytest.raises(NanoKVError, match="block_hash: must be a 32-byte"):
            s.put(b"short", b"x")
        with pytest.raises(NanoKVError, match="parent_hash"):
            s.put(blocks()[0], b"x", "abc")  # type: ignore[arg-type]


def test_budget_respected_and_shrunk_budget_drops_oldest(tmp_path):
    hs = blocks(tokens=list(range(160)))  # 10 blocks
    d = str(tmp_path / "l3")
    with DiskStore(d, 3 * 8192, FP) as s:
        per = s.charge(5000)
        assert per == 8192  # 184 + 5000 bytes, rounded to the filesystem's 4 KiB blocks
        fill(s, hs[:3])
        assert not s.put(hs[3], payload(3))
        assert s.stats()["disk_tier_admit_refused_full_total"] == 1 and s.admitting  # the budget, not the disk
        assert s.get(hs[0]) == payload(0)  # hs[0] is now the most recent
        assert s.evict_for(5000) == [hs[1]]
        assert s.put(hs[3], payload(3)) and s.used_bytes == 3 * per <= s.capacity_bytes
        assert s.keys() == [hs[2], hs[0], hs[3]]
        assert not s.put(hs[4], b"y" * (3 * 8192))  # larger than the whole budget
        assert s.evict_for(3 * 8192) == []
    with DiskStore(d, 2 * 8192, FP) as s:  # the budget shrank across the restart
        assert s.reindex_report.dropped == {"over_budget": 1} and len(s) == 2 and s.used_bytes == 2 * 8192


class FullDisk(DiskIO):
    """A disk that fills up: every write fails with a real ENOSPC until `space` is set again."""

    def __init__(self) -> None:
        self.full = False
        self.writes = 0

    def write_new(self, dir_fd, name, parts, fsync):
        self.writes += 1
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write_new(dir_fd, name, parts, fsync)


def test_enospc_injected_stops_admitting_once_then_retries(tmp_path, caplog):
    hs = blocks(tokens=list(range(160)))
    io = FullDisk()
    with DiskStore(str(tmp_path / "l3"), 1 << 20, FP, io=io, retry_after_s=0.2) as s:
        fill(s, hs[:2])
        io.full = True
        with caplog.at_level(logging.INFO, logger=LOG):
            assert not s.put(hs[2], payload(2))  # no exception: a refusal
            assert not s.admitting and s.admit_reason == "disk_full"
            assert not s.put(hs[3], payload(3)) and not s.put(hs[4], payload(4))
            assert io.writes == 3  # in back-off nothing touches the disk
            assert len(warnings_of(caplog, "stops admitting blocks")) == 1
            st = s.stats()
            assert st["disk_tier_admitting"] == 0 and st["disk_tier_admit_refused_disk_full_total"] == 1
            assert st["disk_tier_admit_refused_unavailable_total"] == 2
            assert s.get(hs[0]) == payload(0)  # reads carry on
            time.sleep(0.25)
            assert s.admitting and not s.put(hs[5], payload(5))  # the retry fails: back off again, quietly
            assert len(warnings_of(caplog, "stops admitting blocks")) == 1 and not s.admitting
            assert s.remove(hs[0]) and s.admitting  # freeing space allows a retry at once
            io.full = False
            assert s.put(hs[6], payload(6)) and s.admit_reason == "ok"
            assert any("admitting again" in r.getMessage() for r in caplog.records)
        assert not [n for n in os.listdir(tmp_path / "l3") if n.startswith(".tmp-")]


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 1 MiB tmpfs (needs root / CAP_SYS_ADMIN; skipped otherwise: the injected test above
    covers the same path)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_enospc_on_a_real_full_filesystem(tiny_fs, caplog):
    hs = blocks(tokens=list(range(16 * 12)))
    with DiskStore(str(tiny_fs / "l3"), 100 << 20, FP, retry_after_s=60) as s:  # budget > the disk
        assert any("exceeds" in m for m in warnings_of(caplog, "disk_cache_bytes"))
        stored = [h for i, h in enumerate(hs) if s.put(h, payload(i, 200_000))]
        assert 2 <= len(stored) < 6 and stored == hs[:len(stored)]  # ~1 MiB holds a few 200 kB blocks
        assert not s.admitting and s.admit_reason == "disk_full"
        assert len(warnings_of(caplog, "stops admitting blocks")) == 1
        assert s.stats()["disk_tier_admit_refused_disk_full_total"] == 1
        assert [n for n in os.listdir(tiny_fs / "l3") if n.startswith(".tmp-")] == []  # no half file left
        assert all(s.get(h) == payload(i, 200_000) for i, h in enumerate(stored))
        assert s.remove(stored[0]) and s.admitting
        assert s.put(hs[-1], payload(0, 100_000)) and s.get(hs[-1]) == payload(0, 100_000)
        subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
        assert not s.put(hs[-2], b"z" * 1000) and s.admit_reason == "read_only"  # EROFS: refused, no raise
        assert s.get(hs[-1]) == payload(0, 100_000)
    with DiskStore(str(tiny_fs / "l3"), 100 << 20, FP) as s:  # a restart on the read-only disk serves reads
        assert not s.admitting and s.admit_reason == "read_only" and len(s) == len(stored)
        assert s.get(hs[-1]) == payload(0, 100_000) and not s.put(hs[-2], b"z")


class SlowDisk(DiskIO):
    def __init__(self) -> None:
        self.gate = threading.Event()
        self.stall_reads = self.stall_writes = False

    def read(self, dir_fd, name, head, whole):
        if self.stall_reads:
            self.gate.wait(10)
        return super().read(dir_fd, name, head, whole)

    def replace(self, dir_fd, src, dst):
        if self.stall_writes:
            self.gate.wait(10)
        super().replace(dir_fd, src, dst)


def test_slow_disk_is_a_counted_miss_never_a_hang(tmp_path, caplog):
    hs = blocks()
    io = SlowDisk()
    d = tmp_path / "l3"
    with DiskStore(str(d), 1 << 20, FP, io=io, timeout_s=0.2, io_workers=2) as s:
        fill(s, hs[:2])
        io.stall_reads = io.stall_writes = True
        t0 = time.monotonic()
        assert s.get(hs[0]) is None  # abandoned after 0.2 s
        assert not s.put(hs[2], payload(2))  # the write stalls before its rename: not admitted
        assert s.get(hs[1]) is None  # both workers are stuck: refused at once, not queued
        assert time.monotonic() - t0 < 2.0
        st = s.stats()
        assert st["disk_tier_timeouts_total"] == 2 and st["disk_tier_busy_total"] == 1
        assert st["disk_tier_misses_total"] == 2
        assert warnings_of(caplog, "slower than 0.2 s")
        io.gate.set()  # the disk wakes up: the abandoned write takes its file back
        for _ in range(100):
            if not s.contains(hs[2]) and not (d / file_name(hs[2])).exists() and s.get(hs[1]) is not None:
                break
            time.sleep(0.02)
        io.stall_reads = io.stall_writes = False
        assert not s.contains(hs[2]) and not (d / file_name(hs[2])).exists()
        assert s.get(hs[0]) == payload(0) and s.put(hs[2], payload(2)) and s.get(hs[2]) == payload(2)


def test_tenants_never_share_blocks_even_across_a_restart(tmp_path):
    a, b = blocks("tenant-a"), blocks("tenant-b")
    assert not set(a) & set(b) and not set(a) & set(blocks(None))  # same tokens, disjoint keys
    d = str(tmp_path / "l3")
    with DiskStore(d, 1 << 20, FP) as s:
        fill(s, a)
        assert all(s.get(h) is None for h in b) and all(not s.contains(h) for h in b)
    with DiskStore(d, 1 << 20, FP) as s:
        assert set(s.keys()) == set(a)
        assert all(s.get(h) is None for h in b)
        assert [s.get(h) for h in a] == [payload(i) for i in range(4)]
        fill(s, b)  # tenant B's own blocks live beside A's, each found only by its own hashes
        assert [s.get(h) for h in b] == [payload(i) for i in range(4)] and len(s) == 8
