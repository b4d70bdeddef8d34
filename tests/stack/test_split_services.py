"""The three services as separate processes over real gRPC (unix sockets): greedy output equals the
in-process LLM() and HF transformers token for token, with prefix hits, preemption, eviction under a
tiny pool, chunked prefill, and int8 / int4 KV; the cache counters agree between the transports; a
step costs one plan call and one step call."""

from __future__ import annotations

import pytest

from nanokv.config import EngineConfig
from nanokv.gateway.llm import LLM
from nanokv.launch import start_services
from nanokv.sampling import SamplingParams
from tests.conftest import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

# 12 blocks of 16 tokens cannot hold six ~40-token prompts + 24 tokens each: with the
# prompts sent twice (prefix hits on the second round) the pool preempts and evicts
TINY = dict(num_gpu_blocks=12, block_size=16, max_num_batched_tokens=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def prompts(chat_ids):
    return chat_ids[:4] + chat_ids[:2]  # the last two are prefix hits of the first two


@pytest.fixture(scope="module")
def reference(hf_model, chat_ids):
    return [hf_greedy(hf_model, ids, GREEDY.max_tokens) for ids in chat_ids[:4]]


def _split_llm(svc, **kw) -> LLM:
    return LLM(**kw, cache_address=svc.cache_address, compute_address=svc.compute_address)


@pytest.fixture(scope="module")
def tiny_services():
    """One cache + compute process pair for both schedulings of the tiny pool (the scheduling is the
    gateway's: the services serve a sync and an async gateway alike)."""
    with start_services(EngineConfig.from_kwargs(**TINY).to_dict()) as svc:
        yield svc


def _split_run(svc, kw, prompts):
    split = _split_llm(svc, **kw)
    # the services as a fresh pair would be (they may have served an earlier gateway): no cached
    # block, a new eviction policy, the cache's and the compute's counters at zero
    split.engine.cache.reset_prefix_cache(clear_stats=True)
    split.engine.compute.reset_stats()
    split_outs = split.generate(prompts, GREEDY, use_tqdm=False)
    split_stats = split.engine.stats()
    split.engine.shutdown()
    return split_outs, split_stats


def _both(kw, prompts, svc=None):
    """The same prompts through the in-process services and through three processes (`svc`'s, else
    a pair started for `kw`)."""
    local = LLM(**kw)
    local_outs = local.generate(prompts, GREEDY, use_tqdm=False)
    local_stats = local.engine.stats()
    if svc is not None:
        return local_outs, local_stats, *_split_run(svc, kw, prompts)
    with start_services(EngineConfig.from_kwargs(**kw).to_dict()) as own:
        return local_outs, local_stats, *_split_run(own, kw, prompts)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_split_equals_in_process_and_hf_under_a_tiny_pool(prompts, reference, tiny_services, async_scheduling):
    # async: the host a step ahead, the next step's plan sent before the step in flight's tokens are read
    local_outs, ls, split_outs, ss = _both(dict(TINY, async_scheduling=async_scheduling), prompts, tiny_services)
    expect = reference + reference[:2]
    assert [o.token_ids for o in split_outs] == expect
    assert [o.token_ids for o in local_outs] == expect
    # the same service code behind both transports: the same block decisions
    for key in ("prefix_hits_tokens", "prefix_queries_tokens", "recomputed_tokens", "preemptions",
                "evictions_by_policy", "computed_tokens"):
        assert ss[key] == ls[key], key
    assert ss["preemptions"] > 0  # the tiny pool preempted
    assert sum(ss["evictions_by_policy"].values()) > 0  # and evicted cached blocks
    assert ss["kv_cache_usage"] == 0.0  # every block back after the last request
    assert [o.num_cached_tokens for o in split_outs] == [o.num_cached_tokens for o in local_outs]
    # chunked prefill: a 64-token budget splits every prompt of ~40+ tokens once batched
    rpc = ss["rpc"]
    assert rpc["steps"] > 0
    assert rpc["step_calls"] <= rpc["steps"] + 2  # one step call per step (+ at most an idle flush)
    assert rpc["plan_calls"] <= rpc["steps"] + 2  # one plan call per step


@pytest.mark.parametrize("bits", [8, 4])
def test_split_quantized_kv_equals_in_process(prompts, bits):
    kw = dict(TINY, enable_compression=True, quantization_bitwidth=bits, block_size=32, num_gpu_blocks=8)
    local_outs, ls, split_outs, ss = _both(kw, prompts)
    assert [o.token_ids for o in split_outs] == [o.token_ids for o in local_outs]
    assert ss["prefix_hits_tokens"] == ls["prefix_hits_tokens"] > 0
    assert ss["compression_error"].keys() == ls["compression_error"].keys()


def test_split_rejects_half_an_address_pair():
    from nanokv.errors import ConfigError

    with pytest.raises(ConfigError, match="compute_address"):
        EngineConfig.from_kwargs(cache_address="unix:/x")


def _abort_run(llm: LLM, prompts) -> dict[str, list[int]]:
    eng = llm.engine
    p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(f"r{i}", prompt, p)
    done: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        steps += 1
        if steps in (5, 9):  # with the next step's plan in flight (async): flush must wait for it
            eng.abort(f"r{steps % 6}")
        done.update({o.request_id: list(o.token_ids) for o in eng.step() if o.finished})
    return done


def test_split_async_aborts_with_a_plan_in_flight_leak_nothing():
    """Async scheduling over gRPC sends each step's plan before the previous step's tokens are read:
    aborts and stops land while a plan is in flight. Outputs equal the in-process engine's, every
    block goes back, the compute service keeps no sequence."""
    import random

    rng = random.Random(3)
    prompts = [[rng.randrange(2, 900) for _ in range(rng.randint(20, 60))] for _ in range(6)]
    kw = dict(model="random:tiny-qwen3", block_size=16, num_gpu_blocks=40, max_num_batched_tokens=64,
              async_scheduling=True)
    want = _abort_run(LLM(**kw), prompts)
    with start_services(EngineConfig.from_kwargs(**kw).to_dict()) as svc:
        split = _split_llm(svc, **kw)
        got = _abort_run(split, prompts)
        split.engine.flush()
        cs, ps = split.engine.cache.stats(), split.engine.compute.stats()
        split.engine.shutdown()
    assert set(got) == set(want) == {"r0", "r1", "r2", "r4"}
    assert got == want
    assert cs["kv_blocks_free"] == cs["kv_blocks_total"] and cs["num_seqs"] == 0
    assert ps["num_seqs"] == 0
