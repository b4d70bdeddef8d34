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


def _both(kw, prompts):
    """The same prompts through the in-process services and through three processes."""
    local = LLM(**kw)
    local_outs = local.generate(prompts, GREEDY, use_tqdm=False)
    local_stats = local.engine.stats()
    with start_services(EngineConfig.from_kwargs(**kw).to_dict()) as svc:
        split = _split_llm(svc, **kw)
        split_outs = split.generate(prompts, GREEDY, use_tqdm=False)
        split_stats = split.engine.stats()
        split.engine.shutdown()
    return local_outs, local_stats, split_outs, split_stats


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_split_equals_in_process_and_hf_under_a_tiny_pool(prompts, reference, async_scheduling):
    # async: the host a step ahead, the next step's plan sent before the step in flight's tokens are read
    local_outs, ls, split_outs, ss = _both(dict(TINY, async_scheduling=async_scheduling), prompts)
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


def test_split_rejects_in_process_only_features():
    from nanokv.errors import ConfigError

    with pytest.raises(ConfigError, match="compression_sparsity"):
        EngineConfig.from_kwargs(compression_sparsity=0.5, cache_address="unix:/x", compute_address="unix:/y")
    with pytest.raises(ConfigError, match="compute_address"):
        EngineConfig.from_kwargs(cache_address="unix:/x")
