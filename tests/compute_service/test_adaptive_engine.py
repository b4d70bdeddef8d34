"""The adaptive controller inside the engine (torch): greedy output is unchanged by it, a layer with
outlier keys is backed off to a safer KV width within a bounded number of steps and the perplexity
returns to the INT8 cache's, re-formatting keeps cached values, recommend mode only reports, and
the counters reach the metrics endpoint."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels on CPU, before any of them runs

from nanokv.compute_service import kv_hooks as hooks
from nanokv.compute_service.adaptive.precision import PrecisionActuator
from nanokv.compute_service.runner.kv_reformat import reformat_layer
from nanokv.config import parse_bitwidth
from nanokv.gateway.adaptive import AdaptiveController, AdaptiveSettings
from nanokv.gateway.adaptive.settings import PATIENCE_WINDOWS
from nanokv.gateway.llm import LLM
from nanokv.gateway.metrics import EngineMetrics
from nanokv.kernels import reference
from nanokv.kv.blockquant import quantize_filled
from nanokv.kv.cache import FullKV, allocate_layer_cache
from nanokv.kv.rotation import rotation_matrix
from nanokv.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def test_greedy_identical_with_the_controller_on_and_off(chat_ids):
    # 20 blocks x 8 tokens for six ~50-token sequences: preemptions, evictions, prefix hits
    kw = {"num_gpu_blocks": 20, "block_size": 8, "max_num_batched_tokens": 256}
    off = LLM(**kw)
    ref = [o.token_ids for o in off.generate(chat_ids, GREEDY, use_tqdm=False)]
    on = LLM(**kw, adaptive=True, eviction_policy="adaptive", adaptive_window_steps=4)
    got = [o.token_ids for o in on.generate(chat_ids, GREEDY, use_tqdm=False)]
    assert got == ref
    stats = on.engine.stats()
    assert stats["adaptations"]["max_num_seqs"] >= 1  # it really acted during the run
    assert on.engine.scheduler.max_num_seqs < 256
    assert stats["eviction_policy"] == on.engine.cache_manager.policy_name
    assert on.engine.cache_manager.num_used_blocks() == 0


def test_outlier_layer_backs_off_and_perplexity_returns_to_int8():
    """Layer 5 is planned int4 (the others int8); the test hook gives it 150x key outliers, which int4
    cannot hold (+5-9 % perplexity). The controller must widen it within 2 windows; from then on the
    run scores what an all-INT8 cache scores on the same tokens (KL within the INT8 target)."""
    from nanokv_tools.eval.corpus import read_corpus
    from nanokv_tools.eval.perplexity import run_perplexity
    from nanokv_tools.eval.runners import build
    from nanokv_tools.eval.settings import Setting, preset

    layer, window = 5, 2
    plan = parse_bitwidth({"default": 8, "layers": {str(layer): 4}})
    bench = build([Setting("adaptive", plan), Setting("static", plan), preset("int8")], None, 64, 16, 1024)
    act = PrecisionActuator(bench.runners["adaptive"], every=1)
    ctl = AdaptiveController(AdaptiveSettings(window_steps=window), precision=act)
    try:
        _, text = read_corpus(None)
    except Exception as e:  # noqa: BLE001 - the corpus package is optional
        pytest.skip(f"no eval corpus: {e}")
    toks = bench.engine.tokenizer(text)["input_ids"]
    windows = [toks[i * 256:(i + 1) * 256] for i in range(5)]
    per_window = []
    with hooks.key_outliers(layer, 150.0):
        for w in windows[:4]:  # 4 chunks of 64 tokens each: one controller step per chunk
            per_window.append({n: c.summary() for n, c in run_perplexity(
                bench, [w], 64, progress=lambda _: ctl.on_step()).items()})
    widen = [d for d in ctl.decisions if d.kind == "kv_bits"]
    assert len(widen) == 1 and widen[0].step <= 2 * window and widen[0].applied
    assert f"layer {layer}: 4 -> 8 bits" in widen[0].action
    assert act.current_bits()[layer] == 8 and bench.runners["adaptive"].kv_caches[layer].bits == 8
    for r in per_window[1:]:  # every window after the back-off
        assert r["static"]["kl_mean"] > 0.02 and r["static"]["delta_ppl_pct"] > 2.0  # the outliers hurt
        assert r["adaptive"]["kl_mean"] <= 0.002  # the INT8 target
        assert abs(r["adaptive"]["ppl"] - r["int8"]["ppl"]) <= 1e-4 * r["int8"]["ppl"]
    # outliers gone: int4 measures low again; back to the planned width after PATIENCE_WINDOWS windows
    steps = 0
    while act.current_bits()[layer] != 4 and steps < 4 * window * PATIENCE_WINDOWS:
        bench.runners["adaptive"].execute([(windows[4], 0, 64, list(range(4)), True)], all_logits=True)
        ctl.on_step()
        steps += 1
    assert act.current_bits()[layer] == 4, [(d.step, d.action, d.reason) for d in ctl.decisions]
    assert steps <= (PATIENCE_WINDOWS + 1) * window


def test_triton_backend_after_a_switch_matches_the_torch_reference():
    """A layer re-formatted mid-run is read by the Triton kernels (they dispatch on cache.bits per
    call): the whole run's greedy output equals the torch reference path's (fp32; batch_invariant
    off, so the torch path reads int4 blocks by the kernels' rule)."""
    pytest.importorskip("triton")
    prompts = [[(7 * i + 3 + j) % 997 + 2 for i in range(40)] for j in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs, bits = {}, {}
    for backend in ("triton", "torch"):
        llm = LLM("random:tiny-llama", num_gpu_blocks=32, block_size=16, max_num_batched_tokens=256, device="cpu",
                  attention_backend=backend, enable_compression=True, quantization_bitwidth=4, adaptive=True,
                  adaptive_window_steps=2, adaptive_compression_error_bound=0.4, batch_invariant=False)
        with hooks.key_outliers(0, 100.0):
            outs[backend] = [[o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for _ in range(2)]
        bits[backend] = [c.bits for c in llm.engine.runner.kv_caches]
        assert llm.engine.stats()["adaptations"]["kv_bits"] == 1
    assert bits["triton"] == bits["torch"] == [8, 4]
    assert outs["triton"] == outs["torch"]


def test_reformat_widening_keeps_values_narrowing_requantizes():
    torch.manual_seed(0)
    N, H, bs, D = 6, 2, 16, 64
    k, v = torch.randn(N * bs, H, D), torch.randn(N * bs, H, D)
    slots, ids = torch.arange(N * bs), torch.arange(N)
    c8 = allocate_layer_cache(8, N, H, bs, D, torch.float32, "cpu", rotate=True)
    reference.store_kvcache(k, v, c8, slots)
    c16 = reformat_layer(c8, 16, torch.float32)
    assert isinstance(c16, FullKV) and c16.rotate  # the key rotation travels along: keys stay in that basis
    for a, b in zip(reference.gather_kv(c16, ids, torch.float32), reference.gather_kv(c8, ids, torch.float32)):
        assert torch.equal(a, b)  # int8 x fp16 scale is exact in float32
    back = reformat_layer(c16, 8, torch.float32)
    assert torch.equal(back.k, c8.k) and torch.equal(back.k_scale, c8.k_scale)  # requantized to the same codes
    c4 = allocate_layer_cache(4, N, H, bs, D, torch.float32, "cpu")
    c4.stage.plan(slots[:-3].numpy())  # the last block stays open (staged in full precision)
    reference.store_kvcache(k[:-3], v[:-3], c4, slots[:-3])
    quantize_filled(c4)
    c4.stage.finish()
    w8 = reformat_layer(c4, 8, torch.float32)
    k4, v4 = reference.gather_kv(c4, ids, torch.float32)
    k8, v8 = reference.gather_kv(w8, ids, torch.float32)
    assert float((k8 - k4).norm() / k4.norm()) < 0.01  # int4 values kept, plus int8 rounding
    r = rotation_matrix(D)
    assert float((v8 - v4 @ r.T).norm() / v4.norm()) < 0.01  # int4 keeps v R: rotated back for int8
    n4 = reformat_layer(w8, 4, torch.float32, stage=c4.stage)  # narrowing: the open block stays staged
    assert n4.stage is c4.stage and int(c4.stage.stage_of[N - 1]) >= 0
    k4b, v4b = reference.gather_kv(n4, ids, torch.float32)
    assert torch.equal(k4b[-1], k8[-1]) and torch.allclose(v4b[-1], v8[-1] @ r, atol=1e-5)
    assert float((k4b - k8).norm() / k8.norm()) < 0.06  # the full blocks: int4 again


@pytest.mark.parametrize("mode", ["act", "recommend"])
def test_engine_modes_and_metrics(mode):
    # a random model's attention logits spread ~1 (SmolLM2's ~3.6), so its bound is set lower; with
    # 100x outliers layer 0 measures ~0.75 at int4, ~0.1 at int8, the clean layer ~0.07 at int4
    llm = LLM("random:tiny-llama", num_gpu_blocks=32, block_size=16, max_num_batched_tokens=256, adaptive=True,
              adaptive_mode=mode, enable_compression=True, quantization_bitwidth=4, adaptive_window_steps=2,
              adaptive_compression_error_bound=0.4)
    prompts = [[(7 * i + 3 + j) % 997 + 2 for i in range(40)] for j in range(4)]
    with hooks.key_outliers(0, 100.0):
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 8 for o in outs)
    stats = llm.engine.stats()
    bits = [c.bits for c in llm.engine.runner.kv_caches]
    if mode == "act":
        assert stats["adaptations"]["kv_bits"] == 1 and bits == [8, 4]
        key = "kv_bits"
    else:
        assert "kv_bits" not in stats["adaptations"] and stats["adaptations"]["kv_bits_recommended"] == 1
        assert bits == [4, 4] and llm.engine.scheduler.max_num_seqs == 256
        key = "kv_bits_recommended"
    m = EngineMetrics()
    m.update(stats)
    assert f'nanokv_adaptations_total{{kind="{key}"}} 1.0' in m.render().decode()


def test_widening_on_cuda_leaves_the_margin_free(monkeypatch):
    """The width rule's memory check runs on CUDA only, so the device is faked here: a widening is
    refused unless the new tensors (and the conversion's scratch) fit with adaptive_pool_margin_bytes
    still free, as for a pool grow; without the margin the same free memory would let it through."""
    from types import SimpleNamespace

    from nanokv.compute_service.kv_hooks import LayerHooks
    from nanokv.compute_service.runner.kv_reformat import CHUNK_BLOCKS
    from nanokv.kv.cache import bytes_per_block

    cuda = SimpleNamespace(type="cuda")
    caches = [SimpleNamespace(bits=4, k=SimpleNamespace(device=cuda), num_blocks=64, num_kv_heads=2,
                              block_size=16) for _ in range(2)]
    applied: list[dict[int, int]] = []
    runner = SimpleNamespace(kv_caches=caches, layer_hooks=[LayerHooks() for _ in caches], head_dim=64,
                             dtype=torch.bfloat16, in_segment={0, 1}, reformat_kv=lambda ok: applied.append(dict(ok)))
    need = 64 * bytes_per_block(8, 2, 16, 64, torch.bfloat16) + 4 * 2 * CHUNK_BLOCKS * 2 * 16 * 64
    margin = 1 << 30
    free = [need + margin]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 4 * free[0]))
    act = PrecisionActuator(runner, margin_bytes=margin)
    assert act.apply({0: 8}) == {} and applied[-1] == {0: 8}
    free[0] -= 1
    refused = act.apply({1: 8})
    assert applied[-1] == {} and "adaptive_pool_margin_bytes (1024 MiB)" in refused[1], refused
    assert PrecisionActuator(runner, margin_bytes=0).apply({1: 8}) == {} and applied[-1] == {1: 8}
