"""Block sparsity with the services as separate processes and with async scheduling, on the embedded
SmolLM2-135M: for every policy, greedy output through three processes equals the in-process LLM()
token for token, synchronous and async, and the cache service made the same decisions (blocks
dropped, demoted) behind both transports. The prompts are short but the protected set is small
(1 sink + 1 recent block of 16 tokens, 2 ranked) and prefill runs in 32-token chunks, so blocks really go
from the second chunk on. The attention policies' scores travel in the step reply and the next plan;
hybrid's INT4 copies in the plan reply and the next step request (no other call)."""

from __future__ import annotations

from pathlib import Path

import pytest

import nanokv.config
from nanokv.config import EngineConfig
from nanokv.gateway.llm import LLM
from nanokv.launch import start_services
from nanokv.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BASE = dict(num_gpu_blocks=48, block_size=16, max_num_batched_tokens=32, max_num_seqs=4, compression_sparsity=0.5,
            sparsity_options="sink_blocks=1,recent_blocks=1,min_ranked=2")
POLICIES = {"streaming": {}, "interval": {}, "attention": {},
            "hybrid": {"enable_compression": True, "quantization_bitwidth": 8}}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from nanokv.compute_service.model.loader import load_tokenizer

    ids = load_tokenizer(None)(Path(nanokv.config.__file__).read_text(), add_special_tokens=False)["input_ids"]
    return [list(ids[:100]), list(ids[40:150])]  # 6 full blocks each (+ 4 and 14 tokens), no shared prefix


def _run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, int]]:
    try:
        # the split services serve a second gateway after the first: no prefix hits on its blocks
        llm.engine.cache.reset_prefix_cache()
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert all(o.error is None for o in outs)
        st = llm.engine.cache.stats()  # in process: the CacheService; split: Cache.Stats over gRPC
        counts = {k: int(st[k]) for k in ("sparsity_blocks_dropped", "sparsity_blocks_demoted", "cache_preemptions")}  # type: ignore[literal-required]
        assert st["kv_cache_usage"] == 0.0  # every block back
        return [o.token_ids for o in outs], counts
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_split_and_async_equal_in_process(prompts, policy):
    kw = dict(BASE, sparsity_policy=policy, **POLICIES[policy])
    local = {mode: _run(LLM(**kw, async_scheduling=mode), prompts) for mode in (False, True)}
    with start_services(EngineConfig.from_kwargs(**kw).to_dict()) as svc:
        split = {mode: _run(LLM(**kw, async_scheduling=mode, cache_address=svc.cache_address,
                                compute_address=svc.compute_address), prompts) for mode in (False, True)}
    for mode in (False, True):
        assert split[mode][0] == local[mode][0], f"async={mode}"  # token for token
        if mode:  # the split services served two gateways: their counters add up
            got = {k: split[True][1][k] - split[False][1][k] for k in split[True][1]}
        else:
            got = split[False][1]
        assert got == local[mode][1], f"async={mode}"  # the same decisions behind both transports
        assert local[mode][1]["sparsity_blocks_dropped"] >= 2 * 2  # sparsity really acted on both
        assert (local[mode][1]["sparsity_blocks_demoted"] > 0) == (policy == "hybrid")
        assert all(len(t) == GREEDY.max_tokens for t in local[mode][0])
