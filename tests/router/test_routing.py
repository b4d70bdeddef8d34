"""The kv score on the router's own structures (no processes): affinity, tenant salts, the cold-replica
guard, and the index a KV-event batch builds."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from nanokv.cache_service.hashing import hash_full_blocks
from nanokv.protos import kv_events_pb2 as ev
from nanokv.router.replica import Replica, ReplicaAddress, parse_replica
from nanokv.router.routing import Router, salt_of

BS = 4


def _replica(port: int, cached: Sequence[bytes] = (), medium: str = "L1", **more: list[bytes]) -> Replica:
    """A replica whose snapshot holds `cached` in `medium` (L1: an older build's name of GPU) and
    more=dict(MEDIUM=hashes); it says REMOTE is a shared medium, as the cache service does."""
    rep = Replica(ReplicaAddress("127.0.0.1", port, port + 1), channel=None, healthy=True)  # type: ignore[arg-type]
    held = [(h, medium) for h in cached] + [(h, m) for m, hs in more.items() for h in hs]
    rep.apply(ev.KvEventBatch(stream_id="s", snapshot=True, last_seq=1, block_size=BS, hash_algo="sha256",
                              shared_media=["REMOTE"],
                              events=[ev.KvEvent(seq=1, cleared=ev.AllBlocksCleared())] +
                              [ev.KvEvent(seq=1, stored=ev.BlockStored(block_hashes=[h], medium=m)) for h, m in held]))
    return rep


def test_the_replica_holding_the_prefix_wins_and_only_for_its_tenant():
    prompt = list(range(1, 30))
    salt = salt_of("tenant-a", None)
    home = _replica(1000, hash_full_blocks(prompt, BS, salt)[:5])
    others = [_replica(2000), _replica(3000)]
    router = Router("kv")
    c = router.choose([*others, home], prompt, salt)
    assert c.order[0] is home and c.predicted_hit_tokens == 5 * BS
    for _ in range(3):  # whatever the round-robin turn; the prompt's own blocks are now expected there too
        c = router.choose([*others, home], prompt, salt)
        assert c.order[0] is home and c.predicted_hit_tokens == (len(prompt) - 1) // BS * BS
    # another tenant's identical prompt: no predicted hit anywhere, the choice is by load and turn
    c = router.choose([*others, home], prompt, salt_of("tenant-b", None))
    assert c.predicted_hit_tokens == 0


def test_a_cold_replica_gets_work_when_the_warm_ones_are_busy():
    shared = list(range(1, 41))  # a long common prefix every warm replica holds
    warm = [_replica(p, hash_full_blocks(shared, BS)) for p in (1000, 2000)]
    cold = _replica(3000)
    for w in warm:
        w.inflight = 8
    c = Router("kv").choose([*warm, cold], [*shared, 7, 8, 9], None)
    assert c.order[0] is cold
    cold.routed.clear()  # (the request just routed there is expected to be cached there: forget it)
    cold.inflight = 7  # balanced enough: the prefix decides again
    assert Router("kv").choose([*warm, cold], [*shared, 7, 8, 9], None).order[0] in warm


def test_events_build_and_clear_the_index():
    rep = _replica(1000, [b"a" * 32, b"b" * 32])
    rep.apply(ev.KvEventBatch(stream_id="s", last_seq=2, events=[
        ev.KvEvent(seq=2, removed=ev.BlockRemoved(block_hashes=[b"a" * 32], medium="L1"))]))
    assert rep.blocks["L1"] == {b"b" * 32} and rep.last_seq == 2
    rep.apply(ev.KvEventBatch(stream_id="s", last_seq=3, events=[ev.KvEvent(seq=3, cleared=ev.AllBlocksCleared())]))
    assert rep.num_blocks_indexed() == 0


def test_replica_specs():
    assert parse_replica("10.0.0.5:8000:50051") == ReplicaAddress("10.0.0.5", 8000, 50051)
    assert parse_replica("[::1]:8000:50051").grpc_target == "[::1]:50051"
    from nanokv.errors import NanoKVError

    with pytest.raises(NanoKVError, match="replicas"):
        parse_replica("host:8000")


def test_a_prefix_is_worth_less_the_lower_its_tier():
    prompt = list(range(1, 30))
    hs = hash_full_blocks(prompt, BS)[:5]
    gpu, cpu, disk = _replica(1000, hs, "GPU"), _replica(2000, hs, "CPU"), _replica(3000, hs, "DISK")
    for _ in range(3):  # whatever the round-robin turn
        for reps, best in (([cpu, disk, gpu], gpu), ([disk, cpu], cpu)):
            for r in reps:
                r.routed.clear()
            c = Router("kv").choose(reps, prompt, None)
            assert c.order[0] is best and c.predicted_hit_tokens == 5 * BS
    assert gpu.cached_prefix(hs) == (5, 5.0) and disk.cached_prefix(hs) == (5, 2.5)
    # a lower tier's move events: stored below, removed above, the index follows
    gpu.apply(ev.KvEventBatch(stream_id="s", last_seq=2, events=[
        ev.KvEvent(seq=2, stored=ev.BlockStored(block_hashes=[hs[4]], medium="CPU")),
        ev.KvEvent(seq=2, removed=ev.BlockRemoved(block_hashes=[hs[4]], medium="GPU"))]))
    assert gpu.cached_prefix(hs) == (5, 4.8)


def test_the_shared_tier_attracts_requests_to_no_replica():
    prompt = list(range(1, 30))
    salt = salt_of("tenant-a", None)
    hs = hash_full_blocks(prompt, BS, salt)[:6]
    # writer put the whole prefix in the shared tier; it holds nothing itself any more
    writer, a, b = _replica(1000, REMOTE=hs), _replica(2000), _replica(3000)
    router, firsts = Router("kv"), set()
    for _ in range(3):
        for r in (writer, a, b):
            r.routed.clear()
        c = router.choose([writer, a, b], prompt, salt)
        firsts.add(c.order[0].name)
        assert c.predicted_hit_tokens == 6 * BS  # every replica can load it
    assert len(firsts) == 3  # no affinity: the turn decides
    # a replica's own device blocks before the shared run: it wins, and the shared blocks extend its hit
    own = _replica(4000, hs[:2], "GPU")
    for r in (writer, a, b):
        r.routed.clear()
    c = router.choose([writer, a, b, own], prompt, salt)
    assert c.order[0] is own and c.predicted_hit_tokens == 6 * BS
    own.routed.clear()
    assert own.cached_prefix(hs, writer.shared_sets()) == (6, pytest.approx(2 + 4 * 0.3))
    # another tenant's salt: the shared blocks are not its blocks
    assert router.choose([writer, a, b], prompt, salt_of("tenant-b", None)).predicted_hit_tokens == 0
