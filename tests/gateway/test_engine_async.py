"""Async scheduling (host one step ahead of the device) computes exactly what synchronous steps do:
same tokens, finish reasons and stops (seen one step late, the extra token dropped), with
preemption, chunked prefill, prefix hits, seeded sampling, logprobs and aborts; no block leaks."""

from __future__ import annotations

import random

import pytest

from nanokv.errors import ConfigError
from nanokv.gateway.llm import LLM
from nanokv.sampling import SamplingParams


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, 900) for _ in range(40)]  # a common prefix: prefix-cache hits
    return [(shared if i % 3 == 0 else []) + [rng.randrange(2, 900) for _ in range(rng.randint(3, 70))]
            for i in range(n)]


def _run(async_scheduling: bool, prompts, params, **kw):
    llm = LLM("random:tiny-qwen3", block_size=16, async_scheduling=async_scheduling, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    cm = llm.engine.cache_manager
    assert cm.num_free_blocks() == cm.num_blocks, "KV blocks leaked"
    assert (llm.engine._async is not None) == async_scheduling
    return llm, [(o.token_ids, o.finish_reason, o.stop_reason) for o in outs]


@pytest.mark.parametrize("kw", [
    {"num_gpu_blocks": 256, "max_num_batched_tokens": 512},
    {"num_gpu_blocks": 24, "max_num_batched_tokens": 512},  # tight: preemption while tokens are in flight
    {"num_gpu_blocks": 256, "max_num_batched_tokens": 37},  # chunked prefill mixed with decodes
    {"num_gpu_blocks": 256, "max_num_batched_tokens": 64, "enable_compression": True, "quantization_bitwidth": 4},
], ids=["plain", "preempt", "chunked", "int4-staged"])
def test_greedy_identical_to_sync(kw):
    prompts = _prompts(14)
    rng = random.Random(1)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in prompts]
    _, ref = _run(False, prompts, params, **kw)
    llm, got = _run(True, prompts, params, **kw)
    assert got == ref
    if kw["num_gpu_blocks"] == 24:
        assert llm.engine.scheduler.num_preemptions > 0


def test_stops_seen_one_step_late_are_exact():
    """Stop ids taken from a free run's own outputs: the async run learns of each stop a step late
    and must drop the token it computed meanwhile."""
    prompts = _prompts(10, seed=3)
    free = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * len(prompts)
    _, base = _run(False, prompts, free, num_gpu_blocks=256)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[toks[4 + i % 5]])
              for i, (toks, _, _) in enumerate(base)]
    _, ref = _run(False, prompts, params, num_gpu_blocks=256)
    _, got = _run(True, prompts, params, num_gpu_blocks=256)
    assert got == ref
    assert sum(r == "stop" for _, r, _ in got) >= 8


def test_tensor_parallel_async_identical_to_sync():
    """tp=2 (CPU, gloo, a spawned rank): the previous step's samples are on rank 0 only, so rank 0
    sends the step's fed input ids to rank 1; tokens, stops and finish reasons equal tp=1's
    synchronous run, with preemption and chunked prefill in the mix."""
    prompts = _prompts(10, seed=3)
    free = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    _, base = _run(False, prompts, free, num_gpu_blocks=20, max_num_batched_tokens=64)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                             stop_token_ids=[toks[4 + i % 5]] if i % 2 else [])
              for i, (toks, _, _) in enumerate(base)]
    _, ref = _run(False, prompts, params, num_gpu_blocks=20, max_num_batched_tokens=64)
    llm, got = _run(True, prompts, params, num_gpu_blocks=20, max_num_batched_tokens=64, tensor_parallel_size=2)
    try:
        assert got == ref
        assert sum(r == "stop" for _, r, _ in got) >= 4 and llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.engine.shutdown()


def test_seeded_sampling_and_logprobs_identical():
    prompts = _prompts(8, seed=5)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True,
                             logprobs=2 if i % 4 == 0 else None) for i in range(len(prompts))]
    llm_ref = LLM("random:tiny-qwen3", block_size=16, num_gpu_blocks=256, async_scheduling=False)
    llm = LLM("random:tiny-qwen3", block_size=16, num_gpu_blocks=256, async_scheduling=True)
    ref = llm_ref.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.logprobs for o in got] == [o.logprobs for o in ref]


def test_abort_mid_run_frees_every_block():
    llm = LLM("random:tiny-qwen3", block_size=16, num_gpu_blocks=128, async_scheduling=True)
    eng = llm.engine
    p = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(_prompts(6, seed=7)):
        eng.add_request(f"r{i}", prompt, p)
    for _ in range(6):
        eng.step()
    eng.abort("r1")
    eng.abort("r4")
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert set(done) == {"r0", "r2", "r3", "r5"} and all(len(o.token_ids) == 50 for o in done.values())
    assert eng.cache_manager.num_free_blocks() == eng.cache_manager.num_blocks


def test_streaming_outputs_carry_every_token_once():
    llm = LLM("random:tiny-qwen3", block_size=16, num_gpu_blocks=128, async_scheduling=True)
    eng = llm.engine
    eng.add_request("a", _prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    seen: list[int] = []
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen.extend(o.new_token_ids)
            final = o if o.finished else final
    assert final is not None and seen == final.token_ids and len(seen) == 9 and -1 not in seen


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="async_scheduling"):
        LLM("random:tiny-qwen3", async_scheduling="yes")
    with pytest.raises(ConfigError, match="sparsity_policy"):  # (async scheduling goes with block sparsity)
        LLM("random:tiny-qwen3", async_scheduling=True, compression_sparsity=0.5, sparsity_policy="lru")


def test_real_model_eos_stops_identical():
    """SmolLM2 chat prompts that end on EOS on their own (real tokens, real stops)."""
    msgs = [[{"role": "user", "content": q}] for q in
            ("What is the capital of France?", "Say hi.", "Name a color.", "What is 2+2?")]
    outs = {}
    for mode in (False, True):
        llm = LLM(async_scheduling=mode)
        res = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=40))  # type: ignore[arg-type]
        outs[mode] = [(o.token_ids, o.finish_reason, o.text) for o in res]
        cm = llm.engine.cache_manager
        assert cm.num_free_blocks() == cm.num_blocks
    assert outs[True] == outs[False]
    assert any(r == "stop" for _, r, _ in outs[True])
