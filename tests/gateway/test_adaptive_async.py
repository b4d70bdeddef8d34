"""The in-process adaptive controller under async scheduling (CPU, fp32, async forced on): a change
of the KV tensors or the pool lands the step in flight first (AsyncStepper.land), and that step's
tokens still stream out, in order. The pool rule grows under a burst and shrinks back when idle with
the greedy tokens of a run that never resized; the KV-width rule widens int4 layers in place and
every request finishes; every block is back at the end."""

from __future__ import annotations

import pytest

from nanokv.gateway.adaptive.settings import PATIENCE_WINDOWS
from nanokv.gateway.llm import LLM
from nanokv.sampling import SamplingParams
from tests.stack.test_adaptive_split import BLOCK_BYTES, TINY, burst, stream

pytestmark = pytest.mark.usefixtures("one_thread")


def test_pool_rule_with_a_step_in_flight():
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in LLM(**TINY, num_gpu_blocks=10).generate(burst(8), params, use_tqdm=False)]
    llm = LLM(**TINY, num_gpu_blocks=10, adaptive=True, adaptive_window_steps=2, adaptive_pool_grow_fraction=0.5,
              adaptive_pool_reserve_bytes=20 * BLOCK_BYTES, async_scheduling=True)
    eng = llm.engine
    assert eng._async is not None
    landed: list[int] = []
    land = eng._async.land
    eng._async.land = lambda: (landed.append(eng._async.pending is not None), land())[1]  # type: ignore[method-assign]
    assert stream(eng, burst(8), params) == ref
    stats = eng.stats()
    assert stats["adaptations"]["pool_grow"] >= 1 and stats["kv_blocks_total"] > 10
    assert any(landed)  # a grow came while a step was in flight, and it landed first
    for _ in range(2 * (PATIENCE_WINDOWS + 1)):
        eng.tick_idle()
    assert eng.stats()["adaptations"]["pool_shrink"] == 1 and eng.stats()["kv_blocks_total"] == 10
    assert llm.generate(burst(1), params, use_tqdm=False)[0].token_ids == ref[0]
    cm = eng.cache_manager
    assert cm.num_free_blocks() == cm.num_blocks


def test_width_rule_with_a_step_in_flight():
    llm = LLM(model="random:tiny-llama", device="cpu", num_gpu_blocks=32, block_size=16, max_num_batched_tokens=256,
              adaptive=True, enable_compression=True, quantization_bitwidth=4, adaptive_window_steps=2,
              adaptive_compression_error_bound=0.03, async_scheduling=True)
    eng = llm.engine
    assert eng.runner.layer_bits == [4, 4]
    prompts = [[(7 * i + 3 + j) % 997 + 2 for i in range(40)] for j in range(4)]
    got = stream(eng, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert all(len(t) == 8 for t in got)
    assert any(d.kind == "kv_bits" and d.applied for d in eng.controller.decisions)
    assert max(eng.runner.layer_bits) == 8
    cm = eng.cache_manager
    assert cm.num_free_blocks() == cm.num_blocks
