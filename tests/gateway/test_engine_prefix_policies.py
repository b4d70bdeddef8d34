"""In the engine, greedy output is identical with prefix caching on and off under every eviction
policy, with a cache small enough to force evictions; counters move as they should."""

from __future__ import annotations

import pytest

from nanokv.gateway.llm import LLM
from nanokv.sampling import SamplingParams

POLICIES = ["lru", "lru_k", "clock", "arc", "s3fifo", "sieve", "depth_lru"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def small():
    # 18 blocks x 8 tokens, two sequences at a time: six ~55-token sequences cannot all stay cached
    return LLM(num_gpu_blocks=18, block_size=8, max_num_seqs=2)


@pytest.fixture(scope="module")
def no_cache_outputs(chat_ids):
    eng = LLM(num_gpu_blocks=18, block_size=8, max_num_seqs=2, enable_prefix_caching=False)
    outs = [o.token_ids for o in eng.generate(chat_ids, GREEDY, use_tqdm=False)]
    assert eng.engine.cache_manager.stats.prefix_hits_tokens == 0
    return outs


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_output_identical_with_evictions(small, chat_ids, no_cache_outputs, policy):
    cm = small.engine.cache_manager
    cm.reset_prefix_cache()
    cm.set_policy(policy)
    before = cm.stats.evictions
    hits_before = cm.stats.prefix_hits_tokens
    # a shared system prompt makes every request hit the first blocks of earlier ones
    outs = small.generate(chat_ids, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == no_cache_outputs
    assert cm.stats.evictions > before, "the cache was meant to be small enough to evict"
    assert cm.stats.prefix_hits_tokens > hits_before
    assert cm.num_used_blocks() == 0


def test_salted_requests_do_not_share(small, chat_ids):
    cm = small.engine.cache_manager
    cm.reset_prefix_cache()
    small.generate([chat_ids[0]], GREEDY, use_tqdm=False, cache_salt="tenant-a")
    hits = cm.stats.prefix_hits_tokens
    o = small.generate([chat_ids[0]], GREEDY, use_tqdm=False, cache_salt="tenant-b")[0]
    assert o.num_cached_tokens == 0 and cm.stats.prefix_hits_tokens == hits
    o2 = small.generate([chat_ids[0]], GREEDY, use_tqdm=False, cache_salt="tenant-a")[0]
    assert o2.num_cached_tokens > 0


def test_recompute_counted_after_preemption(chat_ids):
    eng = LLM(num_gpu_blocks=24, block_size=16, max_num_batched_tokens=128)
    eng.generate(chat_ids[:4], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    st = eng.engine.cache_manager.stats
    assert eng.engine.scheduler.num_preemptions > 0
    assert st.preemptions == eng.engine.scheduler.num_preemptions
    assert st.recomputed_tokens > 0
