"""Garbage on the compute service's gRPC API (a real `nanokv compute` process on a real cache
service): malformed bytes, unknown sequences, block ids outside the pool, negative / huge lengths
and ids, stale epochs, row arrays of different lengths, placeholders without a previous sample.

Every call is answered OK (hypothesis may build a valid step), INVALID_ARGUMENT or
FAILED_PRECONDITION, never INTERNAL or a dropped connection; a rejected step changes nothing (no
table kept, the step counter where it was); afterwards a gateway's greedy request still gets the
tokens it got before the garbage.
"""

from __future__ import annotations

import itertools

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanokv.config import EngineConfig
from nanokv.gateway.engine import Engine
from nanokv.launch import start_services
from nanokv.protos import codec
from nanokv.protos import internal_pb2 as pb
from nanokv.protos import internal_pb2_grpc as pb_grpc
from nanokv.rpc import channel
from nanokv.sampling import SamplingParams

# rpc_timeout_s: also how long the compute service holds a step that arrives ahead of its turn
KW = dict(num_gpu_blocks=48, block_size=16, max_num_batched_tokens=256, max_num_seqs=8, rpc_timeout_s=5.0)
BAD = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BIG = 1 << 62
RIDS = itertools.count()
ACCEPTED: list[pb.StepRequest | bytes] = []  # random steps that were valid after all (and ran)


@pytest.fixture(scope="module")
def stack():
    config = EngineConfig.from_kwargs(**KW).to_dict()
    with start_services(config) as svc:
        eng = Engine(EngineConfig.from_kwargs(**KW, cache_address=svc.cache_address,
                                              compute_address=svc.compute_address))
        prompt = eng.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}])
        ref, _ = _greedy(eng, prompt)
        ch = channel(svc.compute_address)
        try:
            yield svc, eng, pb_grpc.ComputeStub(ch), ch, prompt, ref
        finally:
            ch.close()
            eng.shutdown()


def params(temperature: float) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=temperature, top_p=1.0)


def _greedy(eng: Engine, prompt: list[int]) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens served from the prefix cache)."""
    eng.add_request(f"r{next(RIDS)}", prompt, GREEDY)
    while True:
        for o in eng.step():
            if o.finished:
                return list(o.token_ids), o.num_cached_tokens


def _good_run_after(stack, *, rogue_steps_ran: bool) -> None:
    """A gateway's request after the garbage gets the reference tokens. Its prompt's blocks are in
    the prefix cache, and a hit reads them: so a rejected step that wrote KV would show here. A step
    the compute service accepted wrote wherever its tables said (it trusts the tables the gateway
    relays from the cache service's plan): then the prefix cache is reset first."""
    svc, eng, stub, _, prompt, ref = stack
    assert all(p.poll() is None for p in svc.procs), "a service died"
    eng.recovery.attach()  # what any garbage step left goes (sequences, tables, the step counter)
    if rogue_steps_ran:
        eng.cache.reset_prefix_cache()
    tokens, cached = _greedy(eng, prompt)
    assert tokens == ref
    assert (cached == 0) if rogue_steps_ran else (cached >= 16)
    s = eng.cache.stats()
    assert s["kv_cache_usage"] == 0.0 and s["num_seqs"] == 0


def _send(stub, ch, req: pb.StepRequest | bytes) -> grpc.StatusCode:
    try:
        if isinstance(req, bytes):
            ch.unary_unary("/nanokv.internal.v1.Compute/Step")(req, timeout=30)
        else:
            stub.Step(req, timeout=30)
    except grpc.RpcError as e:
        assert e.code() in BAD, (e.code(), e.details())
        return e.code()
    return grpc.StatusCode.OK


def _clean(stub) -> None:
    stub.Reset(pb.Empty(), timeout=30)
    assert stub.Stats(pb.Empty(), timeout=30).num_seqs == 0


def _rejected_changes_nothing(stub, ch, req) -> None:
    _clean(stub)
    if _send(stub, ch, req) != grpc.StatusCode.OK:
        assert stub.Stats(pb.Empty(), timeout=30).num_seqs == 0  # no delta of a rejected step applied
    else:
        ACCEPTED.append(req)


def test_named_garbage(stack):
    svc, eng, stub, ch, prompt, ref = stack
    epoch = stub.Info(pb.Empty(), timeout=30).epoch
    good_row = dict(seq_ids=codec.pack([1]), num_computed=codec.pack([0]), num_new=codec.pack([4]),
                    num_prefills=1, tokens=codec.pack([1, 2, 3, 4]), sample_rows=codec.pack([0]),
                    tables=[pb.TableDelta(seq_id=1, start=0, blocks=codec.pack([0]))],
                    new_seqs=[pb.SeqParams(seq_id=1, params=params(0.0))], epoch=epoch)

    def bad(**kw) -> pb.StepRequest:
        return pb.StepRequest(**{**good_row, **kw})

    cases: list[tuple[str, pb.StepRequest | bytes, grpc.StatusCode]] = [
        ("malformed bytes", b"\xff\xff\xff\xff garbage", grpc.StatusCode.INVALID_ARGUMENT),
        ("truncated int64 array", bad(tokens=b"\x01\x02\x03"), grpc.StatusCode.INVALID_ARGUMENT),
        ("stale epoch", bad(epoch=epoch - 1), grpc.StatusCode.FAILED_PRECONDITION),
        ("step far ahead", bad(step_id=1000), grpc.StatusCode.FAILED_PRECONDITION),
        ("step ahead whose predecessor never comes", bad(step_id=2), grpc.StatusCode.FAILED_PRECONDITION),
        ("unknown sequence", bad(tables=[], new_seqs=[]), grpc.StatusCode.FAILED_PRECONDITION),
        ("block id past the pool", bad(tables=[pb.TableDelta(seq_id=1, blocks=codec.pack([48]))]),
         grpc.StatusCode.INVALID_ARGUMENT),
        ("negative block id", bad(tables=[pb.TableDelta(seq_id=1, blocks=codec.pack([-1]))]),
         grpc.StatusCode.INVALID_ARGUMENT),
        ("table too short", bad(num_new=codec.pack([20]), tokens=codec.pack([1] * 20)),
         grpc.StatusCode.INVALID_ARGUMENT),
        ("delta past its table", bad(tables=[pb.TableDelta(seq_id=1, start=3, blocks=codec.pack([0]))]),
         grpc.StatusCode.INVALID_ARGUMENT),
        ("negative num_computed", bad(num_computed=codec.pack([-5])), grpc.StatusCode.INVALID_ARGUMENT),
        ("zero num_new", bad(num_new=codec.pack([0]), tokens=b""), grpc.StatusCode.INVALID_ARGUMENT),
        ("huge num_new", bad(num_new=codec.pack([BIG]), tokens=codec.pack([1])), grpc.StatusCode.INVALID_ARGUMENT),
        ("huge num_computed", bad(num_computed=codec.pack([BIG])), grpc.StatusCode.INVALID_ARGUMENT),
        ("rows of different lengths", bad(num_computed=codec.pack([0, 0])), grpc.StatusCode.INVALID_ARGUMENT),
        ("tokens do not add up", bad(tokens=codec.pack([1, 2, 3])), grpc.StatusCode.INVALID_ARGUMENT),
        ("sample row out of range", bad(sample_rows=codec.pack([1])), grpc.StatusCode.INVALID_ARGUMENT),
        ("num_prefills out of range", bad(num_prefills=2), grpc.StatusCode.INVALID_ARGUMENT),
        ("token id past the vocabulary", bad(tokens=codec.pack([1, 2, 3, 1 << 40])),
         grpc.StatusCode.INVALID_ARGUMENT),
        ("placeholder without a previous sample", bad(tokens=codec.pack([1, 2, 3, -1])),
         grpc.StatusCode.INVALID_ARGUMENT),
        ("a sequence in two rows", bad(seq_ids=codec.pack([1, 1]), num_computed=codec.pack([0, 4]),
                                       num_new=codec.pack([4, 4]), tokens=codec.pack([1] * 8)),
         grpc.StatusCode.INVALID_ARGUMENT),
        ("samples without params", bad(new_seqs=[]), grpc.StatusCode.FAILED_PRECONDITION),
        ("bad sampling params", bad(new_seqs=[pb.SeqParams(seq_id=1, params=params(-1.0))]),
         grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for name, req, code in cases:
        _clean(stub)
        try:
            if isinstance(req, bytes):
                ch.unary_unary("/nanokv.internal.v1.Compute/Step")(req, timeout=30)
            else:
                stub.Step(req, timeout=30)
        except grpc.RpcError as e:
            assert e.code() == code, (name, e.code(), e.details())
            assert stub.Stats(pb.Empty(), timeout=30).num_seqs == 0, name
            continue
        pytest.fail(f"{name}: accepted")
    _good_run_after(stack, rogue_steps_ran=False)
    _clean(stub)  # the well-formed step itself runs and samples one token (writing block 0)
    res = stub.Step(pb.StepRequest(**good_row), timeout=30)
    assert len(codec.unpack(res.token_ids, "token_ids")) == 1
    _good_run_after(stack, rogue_steps_ran=True)


IDS = st.one_of(st.integers(-3, 50), st.sampled_from([-(1 << 63), (1 << 63) - 1, BIG, 1 << 31]))
ARRAYS = st.lists(IDS, max_size=5)


@st.composite
def step_requests(draw) -> pb.StepRequest:
    tables = draw(st.lists(st.builds(lambda s, start, b: pb.TableDelta(seq_id=s, start=start, blocks=codec.pack(b)),
                                     st.integers(0, 4), st.integers(0, 3), ARRAYS), max_size=3))
    new_seqs = draw(st.lists(st.builds(lambda s, t: pb.SeqParams(seq_id=s, params=params(t)),
                                       st.integers(0, 4), st.sampled_from([0.0, 1.0, -1.0])), max_size=3))
    return pb.StepRequest(
        step_id=draw(st.sampled_from([0, 5, 1 << 40, (1 << 64) - 1])), seq_ids=codec.pack(draw(ARRAYS)),
        num_computed=codec.pack(draw(ARRAYS)), num_new=codec.pack(draw(ARRAYS)),
        num_prefills=draw(st.integers(0, 6)), tokens=codec.pack(draw(ARRAYS)), sample_rows=codec.pack(draw(ARRAYS)),
        tables=tables, new_seqs=new_seqs, finished=codec.pack(draw(ARRAYS)), preempted=codec.pack(draw(ARRAYS)),
        gateway_id=draw(st.sampled_from(["", "g", "x" * 100])))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=step_requests(), epoch=st.sampled_from(["current", "stale", "none"]), data=st.binary(max_size=120))
def test_random_garbage(stack, req, epoch, data):
    _, _, stub, ch, _, _ = stack
    current = stub.Info(pb.Empty(), timeout=30).epoch
    req.epoch = {"current": current, "stale": current - 1, "none": 0}[epoch]
    _rejected_changes_nothing(stub, ch, req)
    _rejected_changes_nothing(stub, ch, data)


def test_good_after_random_garbage(stack):
    print(f"{len(ACCEPTED)} random steps were valid and ran")
    _good_run_after(stack, rogue_steps_ran=bool(ACCEPTED))


def test_pipelined_steps_pass_the_placeholder_check(stack):
    """A pipelining gateway (async scheduling) sends step N+1 before it has step N's tokens: each row's
    last token is the placeholder the check lets through, and the tokens are the same."""
    svc, eng, _, _, prompt, ref = stack
    piped = Engine(EngineConfig.from_kwargs(**KW, cache_address=svc.cache_address, compute_address=svc.compute_address,
                                            async_scheduling=True))
    try:
        assert piped._async is not None
        piped.cache.reset_prefix_cache()
        assert _greedy(piped, prompt)[0] == ref
    finally:
        piped.shutdown()
    eng.recovery.attach()  # the module's gateway takes over again
