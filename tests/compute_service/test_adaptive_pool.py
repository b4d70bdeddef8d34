"""The KV pool grown and shrunk inside a running engine (torch, CPU, fp32): greedy output identical
to a run without resizing, with sequences live across a grow and a partial shrink; prefix-cache hits
on blocks kept across resizes; no block leaks; the controller's pool rule grows under a burst and
shrinks back when idle; recommend mode changes nothing; quantized layers keep their scales."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from nanokv.compute_service.adaptive.pool import PoolActuator
from nanokv.compute_service.runner.kv_resize import resize_layer_cache
from nanokv.gateway.adaptive.settings import PATIENCE_WINDOWS
from nanokv.gateway.engine import Engine
from nanokv.gateway.llm import LLM
from nanokv.gateway.metrics import EngineMetrics
from nanokv.kv.cache import allocate_layer_cache, is_transposed
from nanokv.sampling import SamplingParams

TINY = {"model": "random:tiny-qwen3", "device": "cpu", "dtype": "float32", "block_size": 8,
        "max_num_batched_tokens": 64}
BLOCK_BYTES = 2 * 2 * 2 * 8 * 16 * 4  # tiny-qwen3: 2 layers x K,V x 2 kv heads x 8 tokens x 16 dims x fp32
PREFIX = list(range(100, 116))  # two full blocks shared by every prompt


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def prompts(seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [PREFIX + torch.randint(200, 900, (int(10 + 3 * i),), generator=g).tolist() for i in range(n)]


def run_waves(eng: Engine, waves: list[list[list[int]]], resize_at: dict[tuple[int, int], int],
              between: dict[int, int], max_tokens: int = 12) -> tuple[dict[str, list[int]], dict[str, int], list[int]]:
    """Run each wave to completion; resize_at[(wave, step)] / between[wave] (before the wave starts):
    pool resizes. Returns outputs and cached-token counts by request id, and the sizes reached."""
    act = PoolActuator(eng.runner, eng.cache_manager, reserve_bytes=1 << 40, margin_bytes=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    sizes: list[int] = []
    for w, wave in enumerate(waves):
        if w in between:
            sizes.append(act.resize(between[w])[0])
        for i, p in enumerate(wave):
            eng.add_request(f"{w}-{i}", p, params)
        step = 0
        while eng.has_unfinished_requests():
            if (w, step) in resize_at:
                sizes.append(act.resize(resize_at[(w, step)])[0])
            for o in eng.step():
                if o.finished:
                    outs[o.request_id], cached[o.request_id] = o.token_ids, o.num_cached_tokens
            step += 1
    return outs, cached, sizes


def test_int4_staged_blocks_follow_a_resize():
    """int4 keeps open blocks in staging slots keyed by block id; a grow and shrink with sequences
    live must not change the output. (No preemption in either run: a lossy format's output may
    legitimately change when a preempted sequence is recomputed.)"""
    kw = {**TINY, "enable_compression": True, "quantization_bitwidth": 4}
    waves = [prompts(0, 4), prompts(1, 3)]
    ref_eng = Engine(**kw, num_gpu_blocks=64)
    ref, _, _ = run_waves(ref_eng, waves, {}, {})
    eng = Engine(**kw, num_gpu_blocks=64)
    got, _, sizes = run_waves(eng, waves, {(0, 2): 96, (0, 6): 64}, {1: 80})
    assert ref_eng.scheduler.num_preemptions == 0 and eng.scheduler.num_preemptions == 0
    assert got == ref and sizes[0] == 96 and sizes[2] == 80
    assert eng.runner.stage is not None and eng.runner.stage.stage_of.shape[0] == 80
    assert eng.cache_manager.num_free_blocks() == eng.cache_manager.num_blocks == 80


def test_greedy_identical_across_grow_and_partial_shrink_with_live_sequences():
    waves = [prompts(0, 4), prompts(1, 3)]
    ref, _, _ = run_waves(Engine(**TINY, num_gpu_blocks=12), waves, {}, {})
    eng = Engine(**TINY, num_gpu_blocks=12)
    got, cached, sizes = run_waves(eng, waves, {(0, 2): 40, (0, 6): 12}, {1: 20})
    assert got == ref
    # grown to 40 at step 2; the shrink at step 6 stopped above the highest block still referenced
    # then; wave 1 started on a pool shrunk to 12 and grown again to 20 (the last resize)
    assert sizes[0] == 40 and 12 < sizes[1] < 40 and sizes[2] == 20
    assert all(cached[f"1-{i}"] >= 8 for i in range(3))  # the shared prefix still hits after resizes
    cm = eng.cache_manager
    assert cm.num_used_blocks() == 0 and cm.num_free_blocks() == cm.num_blocks == 20  # no leaks
    assert all(c.num_blocks == 20 for c in eng.runner.kv_caches) and eng.stats()["kv_blocks_total"] == 20


def test_smollm2_greedy_identical_across_grow_and_shrink():
    """The real embedded model (fp32): chat prompts share the template's system prefix."""
    kw = {"device": "cpu", "dtype": "float32", "block_size": 8, "max_num_batched_tokens": 128, "num_gpu_blocks": 16}
    ref_eng = Engine(**kw)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Who wrote Hamlet?",
                 "Name a prime number.", "What is 2 + 2?"]
    chats = [ref_eng.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    waves = [chats[:3], chats[3:]]
    ref, _, _ = run_waves(ref_eng, waves, {}, {}, max_tokens=8)
    eng = Engine(**kw)
    got, cached, sizes = run_waves(eng, waves, {(0, 1): 48, (0, 4): 16}, {1: 24}, max_tokens=8)
    assert got == ref
    assert sizes[0] == 48 and 16 <= sizes[1] < 48 and sizes[2] == 24
    assert all(cached[f"1-{i}"] >= 8 for i in range(2))  # the system prompt's blocks still hit
    assert eng.cache_manager.num_used_blocks() == 0 and eng.cache_manager.num_free_blocks() == 24


def test_the_start_up_segment_goes_once_every_layer_has_moved_out():
    """An in-place grow or re-format moves layers out of the cache service's segment into tensors
    of their own: once the last one has moved (int4 staging included), the segment is freed, not kept
    beside the new tensors, and the runner's layout is the one it now holds (a later repool or
    re-attach asks for that). A partial re-format keeps it. Greedy output is unchanged throughout."""
    kw = {**TINY, "enable_compression": True, "quantization_bitwidth": 4}
    waves = [prompts(0, 3), prompts(1, 3)]
    ref, _, _ = run_waves(Engine(**kw, num_gpu_blocks=64), waves, {}, {})
    eng = Engine(**kw, num_gpu_blocks=48)
    segment = weakref.ref(eng.local_cache.storage.buffer)
    got, _, sizes = run_waves(eng, waves, {}, {1: 64})
    gc.collect()
    assert got == ref and sizes == [64]
    assert segment() is None and eng.local_cache.storage is None and eng.runner.segment_epoch is None
    assert eng.runner.pool_layout.num_blocks == 64 == eng.runner.num_blocks
    eng.repool(num_blocks=40)  # a new segment of the new layout, carved again
    assert eng.local_cache.storage.layout.num_blocks == 40 and eng.runner.in_segment == {0, 1}

    eng = Engine(**TINY, num_gpu_blocks=32, enable_compression=True, quantization_bitwidth=8)
    ref16, _, _ = run_waves(Engine(**TINY, num_gpu_blocks=32), [prompts(2, 3)], {}, {})
    segment = weakref.ref(eng.local_cache.storage.buffer)
    eng.runner.reformat_kv({0: 16})
    gc.collect()
    assert segment() is not None and eng.runner.in_segment == {1}  # layer 1 still views it
    assert eng.runner.pool_layout.layer_bits == [16, 8]
    eng.runner.reformat_kv({1: 16})
    gc.collect()
    assert segment() is None and eng.local_cache.storage is None
    assert run_waves(eng, [prompts(2, 3)], {}, {})[0] == ref16


def test_resize_keeps_quantized_blocks_and_scales():
    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        c = allocate_layer_cache(bits, 6, 2, 8, 16, torch.float32, "cpu")
        for name in c.block_fields:  # codes, scales and zero points: every per-block tensor
            t = getattr(c, name)
            t.copy_(torch.randint(0, 100, t.shape, generator=g).to(t.dtype))
        before = {n: getattr(c, n).clone() for n in c.block_fields}
        grown = resize_layer_cache(c, 10)
        assert type(grown) is type(c) and grown.num_blocks == 10
        assert all(getattr(grown, n).shape[0] == 10 for n in c.block_fields)
        for n, t in before.items():  # blocks [0, 6) kept, [6, 10) zero
            assert torch.equal(getattr(grown, n)[:6], t) and not getattr(grown, n)[6:].any(), (bits, n)
        c = resize_layer_cache(grown, 4)
        for n, t in before.items():
            assert torch.equal(getattr(c, n), t[:4]), (bits, n)
        # int8 and int4 values stay dims-major ([N, H, D, bs] memory), as the kernels read them
        assert is_transposed(c.v) and not is_transposed(c.k)


def controller_run(**kw):
    """A burst of 8 prompts on a 10-block pool with room for 20 more blocks (window 2 steps)."""
    llm = LLM(**{**TINY, "num_gpu_blocks": 10, "adaptive": True, "adaptive_window_steps": 2,
                 "adaptive_pool_grow_fraction": 0.5, "adaptive_pool_reserve_bytes": 20 * BLOCK_BYTES, **kw})
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = [o.token_ids for o in llm.generate(prompts(2, 8), params, use_tqdm=False)]
    return llm, outs


def test_controller_grows_under_a_burst_and_shrinks_back_when_idle():
    base = LLM(**TINY, num_gpu_blocks=10)
    ref = [o.token_ids for o in base.generate(prompts(2, 8), SamplingParams(temperature=0.0, max_tokens=12,
                                                                             ignore_eos=True), use_tqdm=False)]
    llm, got = controller_run()
    eng = llm.engine
    assert got == ref
    counts = eng.stats()["adaptations"]
    assert counts["pool_grow"] >= 1 and counts["pool_shrink"] == 0
    grown = eng.stats()["kv_blocks_total"]
    assert grown > 10 and eng.runner.num_blocks == grown
    for _ in range(2 * (PATIENCE_WINDOWS + 1)):  # idle: the server's engine thread ticks like this
        eng.tick_idle()
    stats = eng.stats()
    assert stats["adaptations"]["pool_shrink"] == 1 and stats["kv_blocks_total"] == 10
    assert all(c.num_blocks == 10 for c in eng.runner.kv_caches)
    assert any(d.kind == "pool_shrink" and "idle for" in d.reason for d in eng.controller.decisions)
    cm = eng.cache_manager
    assert cm.num_used_blocks() == 0 and cm.num_free_blocks() == 10
    # after the shrink the engine still serves, and the metrics show the pool size
    assert llm.generate(prompts(2, 1), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].token_ids == ref[0]
    m = EngineMetrics()
    m.update(eng.stats())
    text = m.render().decode()
    assert "nanokv_kv_cache_blocks 10.0" in text and 'nanokv_adaptations_total{kind="pool_grow"}' in text


def test_recommend_mode_changes_nothing():
    llm, got = controller_run(adaptive_mode="recommend")
    base, ref = controller_run(adaptive=False)
    assert got == ref
    stats = llm.engine.stats()
    assert stats["kv_blocks_total"] == 10 and llm.engine.runner.num_blocks == 10
    assert stats["adaptations"]["pool_grow_recommended"] == 1  # reported once, never applied
    assert "pool_grow" not in stats["adaptations"]


def test_tensor_parallel_resize_in_lock_step():
    """tp=2 (CPU, gloo): both ranks resize their shards through TPModelRunner.resize_kv; greedy output
    equals tp=1 without resizing, across a grow and a partial shrink with live sequences."""
    waves = [prompts(3, 3)]
    ref, _, _ = run_waves(Engine(**TINY, num_gpu_blocks=12), waves, {}, {})
    eng = Engine(**TINY, num_gpu_blocks=12, tensor_parallel_size=2)
    try:
        got, _, sizes = run_waves(eng, waves, {(0, 1): 32, (0, 5): 12}, {})
        assert got == ref and sizes[0] == 32 and 12 <= sizes[1] < 32
        # (rank 1 would fail on a slot past its shard if it had not grown too)
        act = PoolActuator(eng.runner, eng.cache_manager, reserve_bytes=1 << 40, margin_bytes=0)
        assert act.resize(12) == (12, "") and eng.runner.num_blocks == 12 == eng.cache_manager.num_blocks
    finally:
        eng.shutdown()
