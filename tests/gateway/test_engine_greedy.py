"""Greedy decoding equals HF transformers token for token, and is invariant to how it is run."""

from __future__ import annotations

import pytest

from nanokv.gateway.llm import LLM
from nanokv.sampling import SamplingParams
from tests.conftest import hf_greedy

GREEDY64 = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(hf_model, chat_ids):
    """HF greedy continuations, 64 tokens, one prompt at a time (no padding effects)."""
    return [hf_greedy(hf_model, ids, 64) for ids in chat_ids]


def test_greedy_matches_hf(llm, chat_ids, reference):
    outs = llm.generate(chat_ids, GREEDY64, use_tqdm=False)
    for o, ref in zip(outs, reference):
        assert o.token_ids == ref
    assert llm.engine.cache_manager.num_used_blocks() == 0


def test_greedy_with_preemption_matches(chat_ids, reference):
    # 40 blocks of 16 tokens cannot hold six ~100-token sequences at once: forces preemption
    small = LLM(num_gpu_blocks=40, block_size=16, max_num_batched_tokens=256)
    outs = small.generate(chat_ids, GREEDY64, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert small.engine.cache_manager.num_used_blocks() == 0


@pytest.mark.parametrize("chunk", [7, 32])
def test_greedy_with_small_prefill_chunks(chat_ids, reference, chunk):
    eng = LLM(num_gpu_blocks=512, block_size=8, max_num_batched_tokens=chunk, enable_prefix_caching=False)
    outs = eng.generate(chat_ids[:3], GREEDY64, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference[:3]


def test_alone_vs_batch_of_16(llm, chat_ids, reference):
    alone = llm.generate([chat_ids[2]], GREEDY64, use_tqdm=False)[0].token_ids
    batch = [chat_ids[i % len(chat_ids)] for i in range(16)]
    outs = llm.generate(batch, GREEDY64, use_tqdm=False)
    assert alone == reference[2]
    assert outs[2].token_ids == alone
    for i, o in enumerate(outs):
        assert o.token_ids == reference[i % len(chat_ids)]


def test_prefix_caching_on_off_same(llm, chat_ids, reference):
    # second run hits the prefix cache built by the first
    first = llm.generate(chat_ids[:2], GREEDY64, use_tqdm=False)
    second = llm.generate(chat_ids[:2], GREEDY64, use_tqdm=False)
    assert second[0].num_cached_tokens > 0
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == reference[:2]
