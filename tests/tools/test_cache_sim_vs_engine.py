"""The simulator predicts the engine: the same multi-turn request stream, run through the engine on
CPU (embedded model, a 14-block pool) and replayed by nanokv_tools.sim.replay.replay_prompts, gives the
same prefix hit ratio - the engine's cache service runs the very KVCacheManager and policies the
simulator drives. Public API only: LLM(...).generate and llm.engine.stats()."""

from __future__ import annotations

import pytest
from nanokv_tools.sim.replay import replay_prompts
from nanokv_tools.sim.traces import chat_prompts

from nanokv.sampling import SamplingParams

NUM_BLOCKS, BLOCK_SIZE = 14, 8
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _engine_hit_ratio(llm, prompts) -> tuple[float, int]:  # noqa: ANN001 - an LLM
    before = llm.engine.stats()
    llm.generate(prompts, ONE_TOKEN, use_tqdm=False)
    after = llm.engine.stats()
    queries = after["prefix_queries_tokens"] - before["prefix_queries_tokens"]
    hits = after["prefix_hits_tokens"] - before["prefix_hits_tokens"]
    evictions = sum(after["evictions_by_policy"].values()) - sum(before["evictions_by_policy"].values())
    return hits / queries, evictions


@pytest.mark.slow
def test_engine_hit_ratio_is_the_simulated_one() -> None:
    from nanokv import LLM
    from nanokv.errors import NanoKVError

    prompts = chat_prompts(conversations=14, mean_turns=3.0, system_len=16, user_len=4, answer_len=6, active=3)
    try:  # leaf_lru is allowed once nanokv/config.py lists it; until then the engine starts on lru
        llm = LLM(num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=1, eviction_policy="leaf_lru")
        policy = "leaf_lru"
    except NanoKVError:
        llm = LLM(num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=1, eviction_policy="lru")
        policy = "lru"
    got, evictions = _engine_hit_ratio(llm, prompts)
    want, cm = replay_prompts(prompts, policy, NUM_BLOCKS, BLOCK_SIZE)
    assert evictions > 0, "the pool was meant to be small enough to evict"
    assert abs(got - want) <= 0.02, (policy, got, want)
    assert evictions == cm.stats.evictions  # in fact the very same decisions
