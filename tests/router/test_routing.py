"""The kv score on the router's own structures (no processes): affinity, tenant salts, the cold-replica
guard, and the index a KV-event batch builds."""

from __future__ import annotations

from nanokv.cache_service.hashing import hash_full_blocks
from nanokv.protos import kv_events_pb2 as ev
from nanokv.router.replica import Replica, ReplicaAddress, parse_replica
from nanokv.router.routing import Router, salt_of

BS = 4


def _replica(port: int, cached: list[bytes] = ()) -> Replica:
    rep = Replica(ReplicaAddress("127.0.0.1", port, port + 1), channel=None, healthy=True)  # type: ignore[arg-type]
    rep.apply(ev.KvEventBatch(stream_id="s", snapshot=True, last_seq=1, block_size=BS, hash_algo="sha256",
                              events=[ev.KvEvent(seq=1, cleared=ev.AllBlocksCleared())] +
                              [ev.KvEvent(seq=1, stored=ev.BlockStored(block_hashes=[h], medium="L1"))
                               for h in cached]))
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
    import pytest

    from nanokv.errors import NanoKVError
    with pytest.raises(NanoKVError, match="replicas"):
        parse_replica("host:8000")
