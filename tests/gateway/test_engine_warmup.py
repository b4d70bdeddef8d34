"""The start-up warm-up (a GPU engine compiles its prefill paths before serving) runs a chunked
prompt beside a decode through the engine's own scheduler, and leaves nothing behind."""

from __future__ import annotations

from nanokv.gateway.llm import LLM
from nanokv.gateway.warmup import warm_up
from nanokv.sampling import SamplingParams

GREEDY16 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_warmup_chunks_a_prompt_beside_a_decode_and_forgets_it(chat_ids):
    kw = dict(num_gpu_blocks=128, block_size=8, max_num_batched_tokens=512)
    llm = LLM(**kw)
    eng = llm.engine
    steps: list[list[tuple[int, int, bool]]] = []  # per step: (computed, new, is_prefill) per item
    execute = eng.runner.execute

    def spy(items, *a, **k):
        steps.append([(it[1], it[2], it[4]) for it in items])
        return execute(items, *a, **k)
    eng.runner.execute = spy
    warm_up(eng, force=True)
    eng.runner.execute = execute

    assert any(c > 0 and n > 1 and pre for s in steps for c, n, pre in s), "no continuing prefill chunk"
    assert any(any(pre for _, _, pre in s) and any(not pre for _, _, pre in s) for s in steps), "no mixed step"
    assert max(sum(n for _, n, _ in s) for s in steps) <= 2 * 8 + 3
    assert eng.scheduler.max_num_batched_tokens == 512
    assert not eng.has_unfinished_requests() and eng.cache_manager.num_used_blocks() == 0
    st = eng.cache_manager.stats
    assert (st.prefix_queries, st.blocks_allocated, st.blocks_cached, st.evictions) == (0, 0, 0, 0)
    assert eng.counters.tokens == dict.fromkeys(eng.counters.tokens, 0) and eng.scheduler.num_preemptions == 0

    # the warm-up's blocks are gone from the prefix cache and the outputs are a fresh engine's
    outs = llm.generate(chat_ids[:2], GREEDY16, use_tqdm=False)
    assert eng.cache_manager.stats.prefix_hits_tokens == 0
    fresh = LLM(**kw).generate(chat_ids[:2], GREEDY16, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in fresh]


def test_warmup_skips_engines_too_small_for_it():
    eng = LLM(num_gpu_blocks=8, block_size=16, max_model_len=48, max_num_batched_tokens=64).engine
    calls: list[int] = []
    execute = eng.runner.execute
    eng.runner.execute = lambda items, *a, **k: calls.append(len(items)) or execute(items, *a, **k)
    warm_up(eng, force=True)  # 3 bs + 8 = 56 tokens > max_model_len: no request, no error
    assert calls == [] and not eng.has_unfinished_requests()
