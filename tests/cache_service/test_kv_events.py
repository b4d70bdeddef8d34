"""KV events: the cache manager publishes stored / removed / cleared with the same chained hashes as its
index, the log resumes by sequence number and falls back to a snapshot when the ring is too short."""

from __future__ import annotations

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
