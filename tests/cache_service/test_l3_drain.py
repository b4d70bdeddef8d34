"""L2 victims go to the disk tier (L3) from their own host slot, on the disk writer's thread: a plan
only hands the slot over (tiers/serving.py, tiers/disk_tier.py). Real host slots (storage.py HostSlots
over a segment of 16- and 8-bit layers), a real disk store, the planner's order of calls; the compute
service's side (running a plan's copies, then the forward pass writing the blocks it computed) is
played by `_step` on a dict of device blocks."""

from __future__ import annotations

import threading
import time

import pytest

from nanokv.cache_service.hashing import hash_full_blocks
from nanokv.cache_service.manager import KVCacheManager
from nanokv.cache_service.storage import HostSlots, PoolStorage
from nanokv.cache_service.tiers.disk_io import DiskIO
from nanokv.cache_service.tiers.disk_store import DiskStore
from nanokv.cache_service.tiers.disk_tier import DiskTier
from nanokv.cache_service.tiers.formats import TierFormat
from nanokv.cache_service.tiers.serving import ServingTiers
from nanokv.messages import COPY_LOAD, COPY_SAVE, PoolLayout

BS = 4  # tokens per block
L2_SLOTS, STAGING = 2, 4


class Host(HostSlots):
    """The host segment's slots, noting every read a plan makes on its own thread."""

    def __init__(self, storage: PoolStorage):
        super().__init__(storage)
        self.planning = False  # the test's thread is in a plan (not playing the compute service)
        self.plan_thread_reads: list[int] = []

    def _note(self, slot: int) -> None:
        if self.planning and threading.current_thread() is threading.main_thread():
            self.plan_thread_reads.append(slot)

    def views(self, slot: int) -> list[memoryview]:
        self._note(slot)
        return super().views(slot)

    def read(self, slot: int) -> bytes:
        self._note(slot)
        return super().read(slot)


class GatedIO(DiskIO):
    """A disk whose block writes wait while `open` is clear (a slow disk the test controls)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()

    def write_new(self, dir_fd, name, parts, fsync):  # type: ignore[no-untyped-def]
        assert self.open.wait(30), "the test never reopened the disk"
        return super().write_new(dir_fd, name, parts, fsync)


class Rig:
    def __init__(self, tmp_path, spare: int, remote=None):  # type: ignore[no-untyped-def]
        layout = PoolLayout(num_blocks=L2_SLOTS + STAGING + spare, block_size=BS, num_kv_heads=2, head_dim=8,
                            layer_bits=[16, 8], dtype="bfloat16")
        self.host = Host(PoolStorage(layout, False, 1))
        self.io = GatedIO()
        self.store = DiskStore(str(tmp_path / "l3"), 1 << 20, "test", timeout_s=None, io=self.io)
        self.disk = DiskTier(self.store, self.host.slot_bytes, 16)
        self.cm = KVCacheManager(4, BS, eviction_policy="lru")
        self.st = ServingTiers(self.cm, L2_SLOTS, TierFormat("pool", 16, self.host.slot_bytes), disk=self.disk,
                               host=self.host, staging=STAGING, spare=spare, remote=remote)
        self.all_slots = set(range(L2_SLOTS + STAGING + spare))
        self.dev: dict[int, bytes] = {}  # device block -> its bytes
        self.plans = 0

    def content(self, h: bytes) -> bytes:
        """A block's bytes: a function of its hash (equal keys, equal content)."""
        n = self.host.slot_bytes
        return (h * (n // len(h) + 1))[:n]

    def plan(self, seq: str, ids: list[int], copies_done: int | None = None) -> tuple[list, list[int], int]:
        """The planner's calls for one prompt (cache_service/planner.py); returns (copies, table, hit blocks)."""
        self.host.planning = True
        try:
            return self._plan(seq, ids, copies_done)
        finally:
            self.host.planning = False

    def _plan(self, seq: str, ids: list[int], copies_done: int | None) -> tuple[list, list[int], int]:
        st, cm = self.st, self.cm
        deadline = time.monotonic() + 30
        while True:
            self.plans += 1
            st.begin_plan(self.plans - 1 if copies_done is None else copies_done)
            m = cm.match_prefix(ids, None)
            lm = st.begin(m)
            if not st.loading:
                break
            st.cancel(lm)  # disk hits are read on the reader thread: the planner tries again later
            assert time.monotonic() < deadline, "the disk tier's reads never finished"
            time.sleep(0.005)
        assert cm.allocate(seq, len(ids), m) is not None
        table = cm.block_table(seq)
        loaded = st.land(lm, table)
        cm.cache_blocks(seq, ids, len(ids), None)
        st.finish(lm)
        cm.free(seq)
        return st.take_copies(), table, len(m.block_ids) + loaded // BS

    def step(self, ids: list[int], copies: list, table: list[int], hits: int) -> None:
        """The compute service: the copies in order, then the forward pass writes the computed blocks;
        every block the prompt hit must hold its own bytes by then."""
        for kind, block, slot in copies:
            if kind == COPY_SAVE:
                self.host.write(slot, self.dev[block])
            else:
                assert kind == COPY_LOAD
                self.dev[block] = self.host.read(slot)
        for i, h in enumerate(hash_full_blocks(ids, BS)):
            if i < hits:
                assert self.dev[table[i]] == self.content(h), f"block {i} of a hit holds other bytes"
            else:
                self.dev[table[i]] = self.content(h)

    def run(self, seq: str, ids: list[int]) -> int:
        copies, table, hits = self.plan(seq, ids)
        self.step(ids, copies, table, hits)
        return hits

    def wait_written(self) -> None:
        deadline = time.monotonic() + 30
        while self.disk.draining():
            assert time.monotonic() < deadline, "the disk writer never finished"
            time.sleep(0.005)

    def check_slots(self) -> None:
        """Every host slot is in exactly one place: an L2 block's, a free staging or spare one, or the writer's."""
        st = self.st
        held = [st.host_slot(h) for h in st.l2.keys()]
        free_l2 = [st._host_slot[s] for s in st.l2._free]
        with self.disk._lock:  # the writer's slots: being written, or written and not handed back yet
            draining = len(self.disk._slot_refs) + len(self.disk._drained)
        places = held + free_l2 + st.staging + st.spare
        assert len(places) == len(set(places)) and len(places) + draining == len(self.all_slots)

    def close(self) -> None:
        self.io.open.set()
        self.disk.close()
        self.store.close()


A, B, C = list(range(100, 109)), list(range(200, 213)), list(range(300, 313))  # 2, 3 and 3 full blocks


@pytest.fixture
def rig(tmp_path):  # type: ignore[no-untyped-def]
    r = Rig(tmp_path, spare=4)
    yield r
    r.close()


def test_a_demoting_plan_hands_the_victims_slots_to_the_writer_without_reading_them(rig):  # type: ignore[no-untyped-def]
    ha, hb = hash_full_blocks(A, BS), hash_full_blocks(B, BS)
    rig.run("a", A)
    rig.run("b", B)  # a's blocks leave L1 for L2 (the host slots 0, 1)
    assert set(rig.st.l2.keys()) == set(ha) and {rig.st.host_slot(h) for h in ha} == {0, 1}
    rig.io.open.clear()  # the disk stalls: nothing the plan hands over is written yet
    copies, table, hits = rig.plan("c", C)  # b's 3 blocks go to L2, a's 2 go on to L3 ...
    # ... and so would the b block that the last one displaces, but its own COPY_SAVE has not run yet
    in_l2 = [h for h in hb if h in rig.st.l2]
    assert len(in_l2) == 2 and rig.st.unsettled_drops == 1 and not set(hb) & set(rig.disk.tier.keys())
    assert set(rig.disk.tier.keys()) == set(ha) and rig.host.plan_thread_reads == []
    assert rig.disk.draining() == 2 and len(rig.st.spare) == 2
    saved = [slot for kind, _, slot in copies if kind == COPY_SAVE]
    assert set(saved) == {rig.st.host_slot(h) for h in in_l2} and len(saved) == 3
    assert not {0, 1} & set(saved)  # a's slots are the writer's: b's blocks went to spare slots
    rig.check_slots()
    rig.step(C, copies, table, hits)  # the step overwrites the slots b's blocks took
    rig.st.begin_plan(rig.plans)
    assert len(rig.st.spare) == 2  # nothing written yet: no slot came back
    rig.io.open.set()
    rig.wait_written()
    rig.st.begin_plan(rig.plans)
    assert len(rig.st.spare) == 4 and rig.disk.queue_full == 0
    rig.check_slots()
    for h in ha:  # each file holds its block's bytes as they were when L2 evicted it
        assert rig.store.get(h) == rig.content(h)
    # a again: its prefix comes back from the disk (staging slots, then COPY_LOAD) with its own bytes
    assert rig.run("a2", A) == 2
    assert rig.host.plan_thread_reads == []
    rig.check_slots()


def test_a_hit_on_a_block_still_being_written_is_read_from_its_slot(rig):  # type: ignore[no-untyped-def]
    rig.run("a", A)
    rig.run("b", B)
    rig.io.open.clear()
    rig.run("c", C)  # a's blocks: queued for the disk, their bytes still only in their slots
    assert rig.disk.draining() == 2 and not rig.store.keys()
    assert rig.run("a2", A) == 2  # the reader copies them into staging slots; the step checks the bytes
    assert rig.disk.draining() >= 1  # (a2's own demotions are queued behind the stalled writes)
    rig.io.open.set()
    rig.wait_written()
    rig.st.begin_plan(rig.plans)
    rig.check_slots()
    assert rig.host.plan_thread_reads == []


def test_an_unsettled_slot_is_never_drained(rig):  # type: ignore[no-untyped-def]
    rig.run("a", A)
    copies, table, hits = rig.plan("b", B)  # a's blocks go to L2: their COPY_SAVE has not run yet
    # async scheduling: the next plan comes before the step that runs those copies, so a's two and
    # b's first (saved and displaced in this plan) are dropped, not written down
    c_copies, c_table, c_hits = rig.plan("c", C, copies_done=rig.plans - 1)
    assert rig.st.unsettled_drops == 3 and not rig.disk.tier.keys() and rig.disk.draining() == 0
    rig.step(B, copies, table, hits)
    rig.step(C, c_copies, c_table, c_hits)
    rig.wait_written()
    rig.st.begin_plan(rig.plans)
    rig.check_slots()
    assert rig.host.plan_thread_reads == []


def test_without_a_spare_slot_the_victim_is_dropped_not_copied(tmp_path):  # type: ignore[no-untyped-def]
    rig = Rig(tmp_path, spare=1)
    try:
        ha = hash_full_blocks(A, BS)
        rig.run("a", A)
        rig.run("b", B)
        rig.io.open.clear()
        rig.run("c", C)  # a's 2 blocks leave L2, 1 spare slot: the first is written, the writer is behind
        kept = rig.disk.tier.keys()
        assert len(kept) == 1 and set(kept) < set(ha) and rig.disk.queue_full == 1
        assert rig.host.plan_thread_reads == [] and rig.st.disk_stats()["disk_tier_queue_full_total"] == 1
        rig.io.open.set()
        rig.wait_written()
        rig.st.begin_plan(rig.plans)
        rig.check_slots()
        assert rig.store.keys() == kept and rig.store.get(kept[0]) == rig.content(kept[0])
    finally:
        rig.close()


def test_the_shared_tier_gets_the_victims_from_the_disk_writer_too(tmp_path):  # type: ignore[no-untyped-def]
    from nanokv.cache_service.tiers.remote_store import RemoteStore
    from nanokv.cache_service.tiers.remote_tier import RemoteTier
    from tests.helpers_valkey import Server, require_server

    server = Server(require_server(), tmp_path / "valkey").start()
    rig = None
    try:
        store = RemoteStore(server.url, "test", timeout_s=5.0)
        rig = Rig(tmp_path, spare=4, remote=RemoteTier(store, 0))
        ha = hash_full_blocks(A, BS)
        rig.run("a", A)
        rig.run("b", B)
        rig.io.open.clear()
        rig.run("c", C)  # a's blocks go down: to the disk and to the shared tier, from their slots
        assert rig.host.plan_thread_reads == [] and rig.disk.draining() == 2
        rig.io.open.set()
        rig.wait_written()
        assert rig.st.remote is not None
        rig.st.remote.close()  # offers every queued block first
        check = RemoteStore(server.url, "test", timeout_s=5.0)
        assert [check.get(h) for h in ha] == [rig.content(h) for h in ha]
        check.close()
    finally:
        if rig is not None:
            rig.close()
        server.kill()


def test_a_disk_tier_needs_spare_slots(tmp_path):  # type: ignore[no-untyped-def]
    rig = Rig(tmp_path, spare=1)
    try:
        with pytest.raises(ValueError, match="spare host slots"):
            ServingTiers(KVCacheManager(4, BS), L2_SLOTS, TierFormat("pool", 16, rig.host.slot_bytes),
                         disk=rig.disk, host=rig.host, staging=STAGING)
    finally:
        rig.close()


def test_host_slots_read_write_and_views_agree() -> None:
    layout = PoolLayout(num_blocks=3, block_size=BS, num_kv_heads=2, head_dim=8, layer_bits=[16, 8, 8],
                        dtype="bfloat16")
    host = HostSlots(PoolStorage(layout, False, 1))
    data = bytes(range(256)) * (host.slot_bytes // 256) + bytes(host.slot_bytes % 256)
    host.write(1, data)
    assert host.read(1) == data == b"".join(bytes(v) for v in host.views(1))
    assert host.read(0) == bytes(host.slot_bytes) == host.read(2)  # its neighbours untouched
    with pytest.raises(ValueError, match="slot holds"):
        host.write(0, data[:-1])
