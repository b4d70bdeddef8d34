"""Garbage on the cache service's gRPC API (a real `nanokv cache` process): malformed protobuf bytes,
unknown sequences, another gateway's sequences, negative / huge lengths, stale epochs. Each is
rejected with INVALID_ARGUMENT or FAILED_PRECONDITION; afterwards the service still serves and
its block accounting is intact (every block free once the well-behaved gateway releases)."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanokv.protos import codec
from nanokv.protos import internal_pb2 as pb
from nanokv.protos import internal_pb2_grpc as pb_grpc
from nanokv.rpc import channel, wait_serving

BAD = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
LAYOUT = pb.PoolLayout(num_blocks=32, block_size=16, num_kv_heads=1, head_dim=8, layer_bits=[16],
                       dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    sock = tmp_path_factory.mktemp("garbage") / "cache.sock"
    address = f"unix:{sock}"
    proc = subprocess.Popen([sys.executable, "-m", "nanokv.cli", "cache", "--listen", address],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_serving(address, 60)
        ch = channel(address)
        stub = pb_grpc.CacheStub(ch)
        epoch = stub.Attach(pb.AttachRequest(layout=LAYOUT), timeout=10).epoch
        yield stub, ch, epoch
        ch.close()
    finally:
        proc.terminate()
        proc.wait(10)


def _intact(stub, epoch):
    """A good gateway's plan still works, and after its release every block is free."""
    stub.Release(pb.ReleaseRequest(gateway_id=""), timeout=10)
    good = pb.PlanRequest(new_seqs=[pb.NewSeq(seq_id=7, token_ids=codec.pack(range(40)))],
                          waiting=codec.pack([7, 40, 0]), token_budget=64, max_num_seqs=4, epoch=epoch,
                          gateway_id="good")
    reply = stub.Plan(good, timeout=10)
    assert codec.unpack(reply.admitted, "admitted") == [7, 0, 40]
    stub.Release(pb.ReleaseRequest(gateway_id="good"), timeout=10)
    s = stub.Stats(pb.Empty(), timeout=10)
    assert s.num_seqs == 0 and s.kv_blocks_free == s.kv_blocks_total == 32 and s.kv_cache_usage == 0.0


def _expect_rejected(fn):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() in BAD, (e.value.code(), e.value.details())


def test_named_garbage(cache):
    stub, ch, epoch = cache
    raw = ch.unary_unary("/nanokv.internal.v1.Cache/Plan")  # bytes in, bytes out
    _expect_rejected(lambda: raw(b"\xff\xff\xff\xff garbage", timeout=10))
    stale = pb.PlanRequest(epoch=epoch + 12345, running=codec.pack([1]), grows=codec.pack([1, 16, 1]))
    _expect_rejected(lambda: stub.Plan(stale, timeout=10))
    unknown = pb.PlanRequest(epoch=epoch, running=codec.pack([99]), grows=codec.pack([99, 16, 1]))
    _expect_rejected(lambda: stub.Plan(unknown, timeout=10))
    _expect_rejected(lambda: stub.Plan(pb.PlanRequest(epoch=epoch, appended=b"\x01\x02\x03"), timeout=10))
    _expect_rejected(lambda: stub.Plan(pb.PlanRequest(
        epoch=epoch, new_seqs=[pb.NewSeq(seq_id=1, token_ids=codec.pack([-5, 3]))]), timeout=10))
    _expect_rejected(lambda: stub.Plan(pb.PlanRequest(
        epoch=epoch, new_seqs=[pb.NewSeq(seq_id=2, token_ids=codec.pack(range(10)))],
        waiting=codec.pack([2, 1 << 40, 0]), token_budget=8, max_num_seqs=4), timeout=10))
    # another gateway's sequence
    stub.Plan(pb.PlanRequest(epoch=epoch, gateway_id="a", new_seqs=[pb.NewSeq(seq_id=3, token_ids=codec.pack([1]))]),
              timeout=10)
    _expect_rejected(lambda: stub.Plan(pb.PlanRequest(epoch=epoch, gateway_id="b", finished=codec.pack([3])),
                                       timeout=10))
    _intact(stub, epoch)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200), ids=st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=6))
def test_random_garbage(cache, data, ids):
    stub, ch, epoch = cache
    raw = ch.unary_unary("/nanokv.internal.v1.Cache/Plan")
    for call in (lambda: raw(data, timeout=10),
                 lambda: stub.Plan(pb.PlanRequest(epoch=epoch, running=codec.pack(ids), grows=codec.pack(ids * 3),
                                                  waiting=codec.pack(ids * 3), token_budget=16, max_num_seqs=2),
                                   timeout=10)):
        try:
            call()
        except grpc.RpcError as e:
            assert e.code() in BAD, (e.code(), e.details())
    assert stub.Stats(pb.Empty(), timeout=10).kv_blocks_total == 32
    _intact(stub, epoch)


def test_dead_gateway_lease_expires(tmp_path):
    """A gateway that goes silent (killed) loses its sequences and blocks after gateway_lease_s."""
    address = f"unix:{tmp_path / 'lease.sock'}"
    proc = subprocess.Popen([sys.executable, "-m", "nanokv.cli", "cache", "--listen", address,
                             "--config-json", '{"gateway_lease_s": 1.0}'],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_serving(address, 60)
        with channel(address) as ch:
            stub = pb_grpc.CacheStub(ch)
            epoch = stub.Attach(pb.AttachRequest(layout=LAYOUT), timeout=10).epoch
            stub.Plan(pb.PlanRequest(new_seqs=[pb.NewSeq(seq_id=1, token_ids=codec.pack(range(100)))],
                                     waiting=codec.pack([1, 100, 0]), token_budget=128, max_num_seqs=4,
                                     epoch=epoch, gateway_id="dead"), timeout=10)
            s = stub.Stats(pb.Empty(), timeout=10)
            assert s.num_seqs == 1 and s.kv_blocks_free == 32 - 7
            t0 = time.monotonic()
            while stub.Stats(pb.Empty(), timeout=10).num_seqs:
                assert time.monotonic() - t0 < 5.0
                time.sleep(0.1)
            s = stub.Stats(pb.Empty(), timeout=10)
            assert s.kv_blocks_free == 32 and s.kv_cache_usage == 0.0
    finally:
        proc.terminate()
        proc.wait(10)
