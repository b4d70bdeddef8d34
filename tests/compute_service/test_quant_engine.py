"""Compression inside the engine: per-layer plans really change formats, prefix caching still hits
on compressed blocks, and the monitor reads what the store path writes (random tiny model: fast)."""

from __future__ import annotations

import torch

from nanokv.gateway.llm import LLM
from nanokv.kv.cache import Int4KV, Int8KV
from nanokv.kv.monitor import CompressionMonitor
from nanokv.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [(7 * i + 3) % 997 + 2 for i in range(45)]  # 2 full 16-token blocks + a partial one


def _llm(**kw) -> LLM:
    return LLM("random:tiny-llama", num_gpu_blocks=64, block_size=16, max_num_batched_tokens=256, **kw)


def test_per_layer_plan_gives_layers_different_formats():
    llm = _llm(enable_compression=True, quantization_bitwidth={"default": 4, "layers": {"-1": 8}})
    c0, c1 = llm.engine.runner.kv_caches
    assert (type(c0), c0.bits, c0.k.dtype, c0.k.shape[-1]) == (Int4KV, 4, torch.uint8, 8)
    assert (type(c1), c1.bits, c1.k.dtype, c1.k.shape[-1]) == (Int8KV, 8, torch.int8, 16)
    assert c0.rotate and c1.rotate  # int8 and int4 keys are stored rotated (the default formats)
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == 8
    assert int(c0.k_scale.count_nonzero()) > 0 and int(c1.k_scale.count_nonzero()) > 0


def test_prefix_caching_hits_compressed_blocks():
    llm = _llm(enable_compression=True, quantization_bitwidth=4)
    eng = llm.engine
    first = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    cached = eng.cache_manager.match_prefix(PROMPT).block_ids  # read-only lookup
    assert len(cached) == 2
    before = [(c.k[cached].clone(), c.k_scale[cached].clone(), c.v[cached].clone())
              for c in eng.runner.kv_caches]
    second = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens >= 32  # both full blocks of the prompt came from the cache
    assert second.token_ids == first.token_ids
    for c, (k, ks, v) in zip(eng.runner.kv_caches, before):
        assert c.k.dtype == torch.uint8 and int(ks.count_nonzero()) > 0  # stored as packed int4
        # the hit blocks were read as stored, never rewritten or requantized
        assert torch.equal(c.k[cached], k) and torch.equal(c.k_scale[cached], ks)
        assert torch.equal(c.v[cached], v)


def test_monitor_in_the_engine_zero_for_fp_and_positive_for_int4():
    errs = {}
    for name, kw in (("fp", {}), ("int4", {"enable_compression": True, "quantization_bitwidth": 4})):
        llm = _llm(**kw)
        mon = CompressionMonitor(every=1).attach(llm.engine.runner.layer_hooks)
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
        errs[name] = mon.snapshot()
    assert set(errs["fp"]) == {0, 1} and max(errs["fp"].values()) < 1e-6
    assert min(errs["int4"].values()) > 0.01


def test_value_rotation_folded_into_the_weights_gives_the_same_run(monkeypatch):
    """int4 layers store values rotated (v R). The engine folds R into v_proj and o_proj instead of
    two GEMMs per layer and step: same greedy tokens, the same cache up to rounding (fp32 on the CPU;
    16-bit weights round the folded product once more), and the int8 layer (no value rotation) left
    alone; without the fold (the eval harness's way) the GEMMs stay."""
    from nanokv.compute_service.runner.model_runner import ModelRunner

    fold = ModelRunner.fold_value_rotations
    plan = {"default": 4, "layers": {"-1": 8}}
    runs = {}
    for flag in ("1", ""):
        monkeypatch.setattr(ModelRunner, "fold_value_rotations", (lambda self: None) if flag else fold)
        llm = _llm(enable_compression=True, quantization_bitwidth=plan, device="cpu", dtype="float32")
        caches = llm.engine.runner.kv_caches
        attn = [layer.self_attn for layer in llm.engine.model.model.layers]
        assert [h.rotate_v_in_weights for h in llm.engine.runner.layer_hooks] == [flag == "", False]
        assert [a.v_rotation_folded for a in attn] == [flag == "", False]
        out = llm.generate([PROMPT, PROMPT[:30]], GREEDY, use_tqdm=False)
        runs[flag] = ([o.token_ids for o in out], [c.v_scale.clone() for c in caches],
                      [a.qkv_proj.weight.clone() for a in attn])
    assert runs["1"][0] == runs[""][0]
    for a, b in zip(runs["1"][1], runs[""][1]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)  # values' fp16 scales, rotated basis both
    w_plain, w_folded = runs["1"][2], runs[""][2]
    assert not torch.equal(w_plain[0], w_folded[0]) and torch.equal(w_plain[1], w_folded[1])


def test_folded_value_rotation_is_the_same_function():
    """LlamaAttention.fold_value_rotation (with a qkv bias): v_proj's output per head is v R and
    o_proj(o R) is o_proj(o), in float64."""
    from nanokv.compute_service.model.config import ModelConfig
    from nanokv.compute_service.model.llama import LlamaAttention
    from nanokv.kv.rotation import rotation_matrix
    torch.manual_seed(0)
    cfg = ModelConfig(architecture="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100, attention_bias=True)
    attn = LlamaAttention(cfg, 0).double()
    for p in attn.parameters():
        p.data.normal_()
    x, o = torch.randn(5, 64, dtype=torch.float64), torch.randn(5, 64, dtype=torch.float64)
    r = rotation_matrix(16, torch.float64)
    n = attn.q_size + attn.kv_size
    v0, y0 = attn.qkv_proj(x)[:, n:], attn.o_proj(o)
    attn.fold_value_rotation(r)
    v1 = attn.qkv_proj(x)[:, n:]
    torch.testing.assert_close(v1.view(5, 2, 16), v0.view(5, 2, 16) @ r)
    torch.testing.assert_close(attn.o_proj((o.view(5, 4, 16) @ r).view(5, 64)), y0)
