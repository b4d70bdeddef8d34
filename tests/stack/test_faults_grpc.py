"""Faults in the split, seen through the public gRPC API (nanokv.v1 Generate) of a real gateway
process over real cache and compute processes (one set for the module, restarted in place):

  - compute SIGKILLed mid-prefill: the stream ends with UNAVAILABLE within 5 s, the gateway stays
    live but not ready (HTTP /health 200 + /ready 503; gRPC health "" SERVING + nanokv.v1.Generation
    NOT_SERVING), a restarted compute service gets an empty prefix cache (no block the dead one
    may have half-written is a hit) and the cut prompt gets the same greedy tokens;
  - compute SIGSTOPped mid-decode: the gateway's step deadline (rpc_timeout_s) ends the stream with
    UNAVAILABLE (DEADLINE_EXCEEDED inside), not an unbounded wait; after SIGCONT the gateway
    re-attaches to the same process and serves the same tokens, no restart needed;
  - cache SIGKILLed mid-decode: the stream ends within 5 s, the compute service turns NOT_SERVING
    and unmaps the dead pool's segment within 5 s, the restarted cache service removes the orphaned
    segment, a new epoch is attached, calls carrying the old epoch are refused, greedy tokens match.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from nanokv_tools.bench.stack import Stack

from nanokv.config import EngineConfig
from nanokv.protos import internal_pb2 as ipb
from nanokv.protos import internal_pb2_grpc as ipb_grpc
from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.protos import nanokv_v1_pb2_grpc as pb_grpc
from nanokv.rpc import channel

RPC_TIMEOUT_S = 4.0  # the gateway's internal deadline (the services keep the default)
CONFIG = EngineConfig.from_kwargs(num_gpu_blocks=160, block_size=16, max_num_batched_tokens=32,
                                  max_num_seqs=8).to_dict()
LONG = " ".join(f"word{i}" for i in range(200))  # ~600 tokens: ~19 prefill steps of 32 tokens
SHORT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
GENERATION = "nanokv.v1.Generation"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack.start(CONFIG, str(tmp_path_factory.mktemp("faults")),
                     gateway_config={"rpc_timeout_s": RPC_TIMEOUT_S}) as s:
        s.wait_ready(120)
        yield s


@pytest.fixture(scope="module")
def api(stack):
    with grpc.insecure_channel(stack.grpc_address) as ch:
        yield pb_grpc.GenerationStub(ch), health_pb2_grpc.HealthStub(ch)


def request(text: str, n: int, salt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, cache_salt=salt,
                              sampling_params=pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


def generate(gen, text: str, n: int, salt: str) -> tuple[list[int], int]:
    """(greedy token ids, cached prompt tokens) of one whole Generate call."""
    ids: list[int] = []
    last = None
    for chunk in gen.Generate(request(text, n, salt), timeout=120):
        ids.extend(chunk.token_ids)
        last = chunk
    assert last is not None and last.finished and len(ids) == n
    return ids, last.usage.cached_prompt_tokens


class Stream(threading.Thread):
    """One Generate call read on a thread: the tokens it got, how it ended and when."""

    def __init__(self, gen, req: pb.GenerateRequest):
        super().__init__(daemon=True)
        self.call = gen.Generate(req, timeout=120)
        self.tokens: list[int] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.ended = 0.0
        self.start()

    def run(self) -> None:
        try:
            for chunk in self.call:
                self.tokens.extend(chunk.token_ids)
        except grpc.RpcError as e:
            self.code, self.details = e.code(), e.details()
        self.ended = time.monotonic()


def wait_for(cond, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - t0


def status(hs, service: str = "") -> int:
    return hs.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def assert_live_not_ready(stack: Stack, hs) -> None:
    assert stack.procs["gateway"].poll() is None
    assert httpx.get(stack.http + "/health", timeout=5).status_code == 200
    r = httpx.get(stack.http + "/ready", timeout=5)
    assert r.status_code == 503 and r.json()["status"] == "not ready", r.text
    wait_for(lambda: status(hs, GENERATION) == NOT_SERVING, 2.0, "gRPC readiness")
    assert status(hs, "") == SERVING


def blocks_settle(gen, timeout_s: float = 10.0) -> pb.ServerInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        info = gen.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        if (info.num_running == info.num_waiting == 0 and info.kv_blocks_free == info.kv_blocks_total) \
                or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def segments_mapped(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f
                if len(line.split(None, 5)) == 6 and "nanokv-kv-" in line}


def compute_epoch(stack: Stack) -> int:
    with channel(stack.compute_address) as ch:
        return ipb_grpc.ComputeStub(ch).Info(ipb.Empty(), timeout=10).epoch


def test_compute_killed_mid_prefill(stack, api):
    gen, hs = api
    ref, cached = generate(gen, LONG, 8, salt="ref")
    assert cached == 0
    cut = Stream(gen, request(LONG, 8, salt="cut"))
    wait_for(lambda: gen.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).num_running >= 1, 30, "admission")
    killed = time.monotonic()
    stack.kill("compute")
    cut.join(10)
    assert cut.code == grpc.StatusCode.UNAVAILABLE, (cut.code, cut.details)
    assert cut.ended - killed < 5.0
    print(f"compute SIGKILL -> UNAVAILABLE in {cut.ended - killed:.2f} s")
    assert cut.tokens == []  # the kill cut its prefill: no token was sampled
    assert_live_not_ready(stack, hs)
    with pytest.raises(grpc.RpcError) as e:  # new requests are refused at once while not ready
        generate(gen, SHORT, 4, salt="")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    t0 = time.monotonic()
    stack.restart("compute")
    print(f"compute restart -> ready in {time.monotonic() - t0 + stack.wait_ready(30):.2f} s")
    wait_for(lambda: status(hs, GENERATION) == SERVING, 2.0, "gRPC readiness back")
    with channel(stack.cache_address) as ch:  # a new pool: nothing the dead process wrote is cached
        s = ipb_grpc.CacheStub(ch).Stats(ipb.Empty(), timeout=10)
    assert s.kv_blocks_cached == 0 and s.num_seqs == 0
    again, cached = generate(gen, LONG, 8, salt="cut")
    assert again == ref and cached == 0
    again, cached = generate(gen, LONG, 8, salt="cut")  # and the prefix cache works again
    assert again == ref and cached > 0 and cached % 16 == 0
    info = blocks_settle(gen)
    assert info.kv_blocks_free == info.kv_blocks_total and info.ready


def test_compute_stalled_mid_decode(stack, api):
    gen, hs = api
    ref, _ = generate(gen, SHORT, 16, salt="stall")
    s = Stream(gen, request(SHORT, 400, salt="stall"))
    wait_for(lambda: len(s.tokens) >= 2, 30, "first tokens")
    stopped = time.monotonic()
    stack.kill("compute", signal.SIGSTOP)
    try:
        s.join(RPC_TIMEOUT_S + 10)
        assert s.code == grpc.StatusCode.UNAVAILABLE and "DEADLINE_EXCEEDED" in s.details, (s.code, s.details)
        assert s.ended - stopped < RPC_TIMEOUT_S + 3.0
        print(f"compute SIGSTOP -> UNAVAILABLE in {s.ended - stopped:.2f} s (rpc_timeout_s {RPC_TIMEOUT_S})")
        assert_live_not_ready(stack, hs)
        time.sleep(1.0)  # the retries meanwhile fail fast and keep it not ready
        assert httpx.get(stack.http + "/ready", timeout=5).status_code == 503
    finally:
        stack.kill("compute", signal.SIGCONT)
    # the same process: the gateway re-attaches, nothing restarted
    print(f"SIGCONT -> ready in {stack.wait_ready(30):.2f} s")
    assert generate(gen, SHORT, 16, salt="stall")[0] == ref
    info = blocks_settle(gen)
    assert info.kv_blocks_free == info.kv_blocks_total


def test_cache_killed_mid_decode(stack, api):
    gen, hs = api
    ref, _ = generate(gen, SHORT, 16, salt="cache")
    compute = stack.pid("compute")
    old = segments_mapped(compute)
    assert len(old) == 1
    old_segment = old.pop()
    old_epoch = compute_epoch(stack)
    s = Stream(gen, request(SHORT, 400, salt="cache"))
    wait_for(lambda: len(s.tokens) >= 2, 30, "first tokens")
    killed = time.monotonic()
    stack.kill("cache")
    s.join(10)
    assert s.code == grpc.StatusCode.UNAVAILABLE, (s.code, s.details)
    assert s.ended - killed < 5.0
    print(f"cache SIGKILL -> UNAVAILABLE in {s.ended - killed:.2f} s")
    # the compute service notices, stops serving and unmaps the dead pool
    with channel(stack.compute_address) as ch:
        chs = health_pb2_grpc.HealthStub(ch)
        wait_for(lambda: status(chs) == NOT_SERVING and old_segment not in segments_mapped(compute),
                 5.0 - (time.monotonic() - killed), "compute detaching")
        print(f"cache SIGKILL -> compute NOT_SERVING, segment unmapped in {time.monotonic() - killed:.2f} s")
        # a step for the dead pool's epoch is refused, not run on memory nobody owns
        with pytest.raises(grpc.RpcError) as e:
            ipb_grpc.ComputeStub(ch).Step(ipb.StepRequest(epoch=old_epoch), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert os.path.exists(old_segment)  # its owner was killed: nobody removed it yet
    assert_live_not_ready(stack, hs)

    t0 = time.monotonic()
    stack.restart("cache")
    print(f"cache restart -> ready in {time.monotonic() - t0 + stack.wait_ready(30):.2f} s")
    assert not os.path.exists(old_segment)  # the new cache service removed the orphan
    assert compute_epoch(stack) > old_epoch
    new = segments_mapped(compute)
    assert len(new) == 1 and old_segment not in new
    assert generate(gen, SHORT, 16, salt="cache")[0] == ref
    with channel(stack.compute_address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ipb_grpc.ComputeStub(ch).Step(ipb.StepRequest(epoch=old_epoch), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "StaleEpoch" in e.value.details()
    with channel(stack.cache_address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ipb_grpc.CacheStub(ch).Plan(ipb.PlanRequest(epoch=old_epoch), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "StaleEpoch" in e.value.details()
    info = blocks_settle(gen)
    assert info.kv_blocks_free == info.kv_blocks_total
