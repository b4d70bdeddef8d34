"""KV events: the cache manager publishes stored / removed / cleared with the same chained hashes as its
index, the log resumes by sequence number and falls back to a snapshot when the ring is too short."""

from __future__ import annotations

import time

from nanokv.cache_service.hashing import hash_full_blocks
from nanokv.cache_service.kv_events import CLEARED, L1, REMOVED, STORED, KVEventLog
from nanokv.cache_service.kv_events_rpc import catchup_to_pb
from nanokv.cache_service.manager import KVCacheManager


def _run(cm: KVCacheManager, seq_id: str, ids: list[int], salt: str | None = None) -> None:
    m = cm.match_prefix(ids, salt)
    assert cm.allocate(seq_id, len(ids), m) is not None
    cm.cache_blocks(seq_id, ids, len(ids), salt)
    cm.free(seq_id)


def test_events_name_the_index_and_follow_evictions_and_reset():
    cm = KVCacheManager(4, 4, eviction_policy="lru")
    log = KVEventLog(capacity=64, block_size=4)
    cm.set_event_log(log)
    a = list(range(100, 109))  # 2 full blocks + 1 token
    _run(cm, "a", a, "tenant=x")
    c = log.read(0, "")
    assert c.snapshot and [e.kind for e in c.events] == [CLEARED, STORED, STORED]
    stored = log.read(0, log.stream_id).events
    hashes = hash_full_blocks(a, 4, "tenant=x")
    assert [e.block_hashes[0] for e in stored] == hashes == list(cm.pool.index)
    assert stored[0].parent == b"" and stored[1].parent == hashes[0] and stored[0].medium == L1
    assert [e.seq for e in stored] == [1, 2]
    # another prompt needs all 4 blocks: both cached blocks go (LRU), each a BlockRemoved
    _run(cm, "b", list(range(200, 213)))
    evs = log.read(2, log.stream_id).events
    removed = [e.block_hashes[0] for e in evs if e.kind == REMOVED]
    assert sorted(removed) == sorted(hashes) and log.num_cached() == len(cm.pool.index) == 3
    assert cm.reset_prefix_cache()
    assert log.read(log.last_seq - 1, log.stream_id).events[-1].kind == CLEARED and log.num_cached() == 0


def test_resume_inside_the_ring_and_snapshot_past_it():
    log = KVEventLog(capacity=3, block_size=16)
    for i in range(5):
        log.stored(bytes([i]) * 32, b"", 16)
    log.removed(bytes([0]) * 32)
    # seqs 1..6; the ring holds 4..6: resuming after 3 reads 4, 5, 6
    c = log.read(3, log.stream_id)
    assert not c.snapshot and [e.seq for e in c.events] == [4, 5, 6] and c.last_seq == 6
    assert log.read(6, log.stream_id).events == []
    # after 2 is gone: a snapshot of the 4 cached blocks at seq 6
    s = log.read(2, log.stream_id)
    assert s.snapshot and s.last_seq == 6 and s.events[0].kind == CLEARED
    assert sorted(e.block_hashes[0][0] for e in s.events[1:]) == [1, 2, 3, 4]
    # another stream's numbering (a restarted cache): a snapshot too
    assert log.read(6, "another").snapshot
    # the snapshot travels in batches; only the first one says so
    batches = list(catchup_to_pb(log, s))
    assert batches[0].snapshot and batches[0].last_seq == 6 and len(batches[0].events) == 5
    assert batches[0].events[1].stored.token_count == 16 and batches[0].events[0].HasField("cleared")


def test_wait_wakes_on_a_new_event():
    import threading

    log = KVEventLog()
    threading.Timer(0.05, lambda: log.stored(b"h" * 32, b"", 16)).start()
    assert log.wait(0, 5.0) and log.last_seq == 1
    assert not log.wait(1, 0.05)


class _HostBytes:
    """The host segment's slots as plain bytes (the serving path's SlotBytes; storage.py's HostSlots
    maps shared memory instead)."""

    def __init__(self, slots: int, slot_bytes: int):
        self.slot_bytes = slot_bytes
        self._b = [bytes(slot_bytes)] * slots

    def views(self, slot: int) -> list[memoryview]:
        return [memoryview(self._b[slot])]

    def read(self, slot: int) -> bytes:
        return self._b[slot]

    def write(self, slot: int, data: bytes) -> None:
        self._b[slot] = data


def _plan(st, cm: KVCacheManager, seq_id: str, ids: list[int]) -> int:
    """The planner's order of calls for one prompt (cache_service/planner.py); every earlier copy done."""
    st.begin_plan(10 ** 9)
    m = cm.match_prefix(ids, None)
    lm = st.begin(m)
    deadline = time.monotonic() + 30
    while st.loading:  # disk hits are read on the reader thread: the planner tries again at a later plan
        st.cancel(lm)
        assert time.monotonic() < deadline, "the disk tier's reads never finished"
        time.sleep(0.005)
        st.begin_plan(10 ** 9)
        m = cm.match_prefix(ids, None)
        lm = st.begin(m)
    assert cm.allocate(seq_id, len(ids), m) is not None
    loaded = st.land(lm, cm.block_table(seq_id))
    cm.cache_blocks(seq_id, ids, len(ids), None)
    st.finish(lm)
    cm.free(seq_id)
    return loaded


def _index(log: KVEventLog) -> dict[str, set[bytes]]:
    """What a subscriber builds from a fresh subscription's snapshot (router/replica.py does the same)."""
    out: dict[str, set[bytes]] = {}
    for e in log.read(0, "").events:
        if e.kind == STORED:
            out.setdefault(e.medium, set()).update(e.block_hashes)
    return out


def test_every_tier_publishes_its_blocks_and_the_snapshot_names_their_tier(tmp_path):
    from nanokv.cache_service.kv_events import CPU, DISK, GPU
    from nanokv.cache_service.tiers.disk_store import DiskStore
    from nanokv.cache_service.tiers.disk_tier import DiskTier
    from nanokv.cache_service.tiers.formats import TierFormat
    from nanokv.cache_service.tiers.serving import ServingTiers

    cm = KVCacheManager(4, 4, eviction_policy="lru")
    log = KVEventLog(block_size=4)
    cm.set_event_log(log)
    host = _HostBytes(2 + 4 + 4, 64)
    store = DiskStore(str(tmp_path), 1 << 20, "test")
    disk = DiskTier(store, 64, 16)
    st = ServingTiers(cm, 2, TierFormat("pool", 16, 64), disk=disk, host=host, staging=4, spare=4)

    def tiers_now() -> dict[str, set[bytes]]:
        return {GPU: set(cm.pool.index), CPU: set(st.l2.keys()), DISK: set(disk.tier.keys())}

    a, b, c = list(range(100, 109)), list(range(200, 213)), list(range(300, 313))
    ha = hash_full_blocks(a, 4)
    _plan(st, cm, "a", a)
    seen = log.last_seq
    _plan(st, cm, "b", b)  # 4 blocks: a's two leave L1 for L2
    evs = log.read(seen, log.stream_id).events
    moved = [(e.kind, e.medium, e.block_hashes[0]) for e in evs if e.block_hashes[0] in ha]
    # each of a's blocks: stored in L2 ("CPU") first, then removed from the device pool ("GPU")
    assert sorted(moved) == sorted([(STORED, CPU, h) for h in ha] + [(REMOVED, GPU, h) for h in ha])
    for h in ha:
        assert moved.index((STORED, CPU, h)) < moved.index((REMOVED, GPU, h))
    assert {e.block_hashes[0]: e.parent for e in evs if e.kind == STORED and e.medium == CPU} == {
        ha[0]: b"", ha[1]: ha[0]}
    _plan(st, cm, "c", c)  # b's blocks push a's out of L2 onto the disk (L3)
    assert _index(log) == tiers_now() and set(ha) <= set(disk.tier.keys())
    disk_events = {e.block_hashes[0]: e.parent for e in log.read(0, "").events if e.medium == DISK}
    assert disk_events[ha[0]] == b"" and disk_events[ha[1]] == ha[0]  # parents survive two moves
    # a again: its prefix loads from the disk into L1 (the disk keeps its copy: keep_on_load)
    assert _plan(st, cm, "a2", a) == 2 * 4
    assert _index(log) == tiers_now() and set(ha) <= set(cm.pool.index) & set(disk.tier.keys())
    # a reset drops L2's copies: each a BlockRemoved there
    st.clear()
    assert not st.l2.keys() and CPU not in _index(log) and _index(log) == {k: v for k, v in tiers_now().items() if v}
    # a restarted cache: the disk's blocks indexed at start-up are in the new log's snapshot
    disk.close()
    cm2 = KVCacheManager(4, 4, eviction_policy="lru")
    log2 = KVEventLog(block_size=4)
    cm2.set_event_log(log2)
    disk2 = DiskTier(store, 64, 16)
    ServingTiers(cm2, 2, TierFormat("pool", 16, 64), disk=disk2, host=_HostBytes(10, 64), staging=4, spare=4)
    snap = log2.read(0, "")
    assert snap.snapshot and _index(log2) == {DISK: set(disk.tier.keys())} and set(ha) <= _index(log2)[DISK]
    assert all(e.token_count == 4 for e in snap.events[1:])
    disk2.close()
    store.close()


def test_the_shared_tier_keeps_its_last_puts_and_says_it_is_shared():
    from nanokv.cache_service.kv_events import REMOTE

    log = KVEventLog(block_size=16, remote_capacity=2)
    log.stored(b"p" * 32, b"", 16)  # in L1 first: its parent goes with it to the shared tier
    log.stored(b"q" * 32, b"p" * 32, 16)
    log.removed(b"q" * 32)
    for h in (b"p" * 32, b"q" * 32, b"r" * 32):
        log.stored(h, None, 16, REMOTE)
    evs = log.read(3, log.stream_id).events
    assert [(e.kind, e.block_hashes[0][:1]) for e in evs] == [
        (STORED, b"p"), (STORED, b"q"), (REMOVED, b"p"), (STORED, b"r")]  # the oldest put is forgotten
    assert evs[1].parent == b"p" * 32 and log.num_cached(REMOTE) == 2
    assert next(catchup_to_pb(log, log.read(0, ""))).shared_media == [REMOTE]
