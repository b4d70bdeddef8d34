"""Tensor parallelism through the whole engine: tp > 1 gives the tp=1 result (CPU, gloo, fp32).

Heads are dealt out by GQA group. SmolLM2-135M (9 query heads over 3 KV heads) splits unevenly at
tp=2 (rank 0: 2 KV + 6 query heads, rank 1: 1 + 3) and evenly at tp=3. tiny-qwen3 (6 query / 2 KV
heads, vocab 1003) splits evenly at tp=2 and tiny-qwen3-kv3 (6 query / 3 KV heads, vocab 1001,
untied head) unevenly; both have a vocab the last rank pads. tp larger than the query-head count
is refused before any process starts.
"""

from __future__ import annotations

import psutil
import pytest
import torch

from nanokv.compute_service.runner.tp_protocol import TokenWindow, _decode, _encode
from nanokv.errors import NanoKVError
from nanokv.gateway.llm import LLM
from nanokv.sampling import SamplingParams

TINY = dict(model="random:tiny-qwen3", num_gpu_blocks=64, block_size=16)


pytestmark = pytest.mark.usefixtures("no_leftover_processes")  # (tests/conftest.py)


def _tiny_prompts() -> list[list[int]]:
    shared = list(range(5, 41))  # 36 tokens: two full blocks reused by the third prompt
    return [shared, list(range(300, 317)), shared + [7, 8, 9, 10], list(range(900, 1000))]


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-kv3"])
def test_tiny_qwen3_tp2_matches_tp1(preset):
    prompts = _tiny_prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    # near-uniform random-weight logits make seeded sampling compare the whole distribution
    sampled = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=s) for s in range(4)]
    # small batches force chunked prefill; the third prompt hits the first one's cached blocks
    kw = dict(TINY, model=f"random:{preset}", max_num_batched_tokens=24)
    ref_llm = LLM(**kw)
    ref = ref_llm.generate(prompts, greedy, use_tqdm=False)
    ref_s = ref_llm.generate(prompts, sampled, use_tqdm=False)
    items = [(prompts[3], 0, 60, [0, 1, 2, 3], True)]
    ref_all = ref_llm.engine.runner.execute(items, all_logits=True)
    tp = LLM(**kw, tensor_parallel_size=2)
    try:
        assert tp.engine.runner.num_blocks == ref_llm.engine.runner.num_blocks
        outs = tp.generate(prompts, greedy, use_tqdm=False)
        outs_s = tp.generate(prompts, sampled, use_tqdm=False)
        got_all = tp.engine.runner.execute(items, all_logits=True)
        # what a warm-up / CUDA-graph capture needs: a runner method run on every rank at once
        again = tp.engine.runner.call_all("execute", items, None, True)
        assert tp.engine.cache_manager.stats.prefix_hits_tokens > 0
        # rank 0's cache holds its KV heads only: 1 of 2 (even split) or 2 of 3 (uneven)
        mc = ref_llm.engine.model_config
        per_block = tp.engine.runner.bytes_per_block_all_layers()
        assert per_block * mc.num_key_value_heads == (
            ref_llm.engine.runner.bytes_per_block_all_layers() * mc.heads_per_rank(2, 0)[1])
        with pytest.raises(AttributeError, match="call_all"):
            tp.engine.runner._decide_num_blocks()  # might run the model on rank 0 only: refused
    finally:
        tp.engine.shutdown()
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.token_ids for o in outs_s] == [o.token_ids for o in ref_s]
    assert len({t for o in outs_s for t in o.token_ids}) > 20  # really sampled, not degenerate
    for o, r in zip(outs, ref):
        for a, b in zip(o.logprobs, r.logprobs):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
    assert got_all.shape == ref_all.shape == (60, ref_llm.engine.model_config.vocab_size)
    assert (got_all - ref_all).abs().max().item() < 1e-4
    assert torch.equal(again, got_all)


def test_shutdown_is_idempotent_and_final():
    llm = LLM(**TINY, tensor_parallel_size=2)
    pids = llm.engine.runner.worker_pids()
    assert len(pids) == 1
    llm.engine.shutdown()
    llm.engine.shutdown()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    llm.engine.add_request("late", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="shut down"):
        llm.engine.step()


def test_tp_larger_than_heads_is_refused_before_any_process_starts():
    with pytest.raises(NanoKVError, match="7 is more than num_attention_heads 6"):
        LLM(**TINY, tensor_parallel_size=7)


@pytest.mark.slow
def test_smollm2_tp2_uneven_heads_matches_tp1(llm, chat_ids):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ids = chat_ids[:2]
    ref = [o.token_ids for o in llm.generate(ids, params, use_tqdm=False)]
    tp = LLM(num_gpu_blocks=32, block_size=16, tensor_parallel_size=2)
    try:
        # rank 0 holds KV heads 0-1 (query heads 0-5): 2 of the 3 KV heads' cache per block
        assert tp.engine.runner.num_kv_heads == 2
        assert tp.engine.runner.bytes_per_block_all_layers() * 3 == llm.engine.runner.bytes_per_block_all_layers() * 2
        assert [o.token_ids for o in tp.generate(ids, params, use_tqdm=False)] == ref
    finally:
        tp.engine.shutdown()


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1(llm, chat_ids):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ids = chat_ids[:3]
    ref = [o.token_ids for o in llm.generate(ids, params, use_tqdm=False)]
    tp = LLM(num_gpu_blocks=256, block_size=16, tensor_parallel_size=3)
    try:
        assert [o.token_ids for o in tp.generate(ids, params, use_tqdm=False)] == ref
    finally:
        tp.engine.shutdown()


def test_step_message_round_trip():
    tokens = list(range(100, 140))
    items = [(tokens, 32, 8, [4, 9, 1], True), ([5, 6, 7], 2, 1, [3], False)]
    header, payload = _encode(items, [0, 1], False)
    step = _decode(header.tolist(), payload)
    assert step.logits_rows == [0, 1] and not step.all_logits
    (w0, s0, n0, t0, p0), (w1, s1, n1, t1, p1) = step.items
    assert (s0, n0, t0, p0, len(w0)) == (32, 8, [4, 9, 1], True, 40)
    assert w0[32:40] == tokens[32:40] and w0[-1] == 139 and (s1, n1, t1, p1) == (2, 1, [3], False)
    assert w1[2:3] == [7]
    with pytest.raises(IndexError, match="only receives positions"):
        w0[0:40]  # older tokens never travel: they are in the KV cache already
    none_rows = _decode(*(lambda h, p: (h.tolist(), p))(*_encode(items, None, True)))
    assert none_rows.logits_rows is None and none_rows.all_logits


def test_token_window_bounds():
    w = TokenWindow(4, [10, 11], 7)
    assert len(w) == 7 and w[4] == 10 and w[5:6] == [11] and w[6:3] == []
    with pytest.raises(IndexError):
        w[6]
