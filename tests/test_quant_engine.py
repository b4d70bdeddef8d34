"""Compression inside the engine: per-layer plans really change formats, prefix caching still hits
on compressed blocks, and the monitor reads what the store path writes (random tiny model: fast)."""

from __future__ import annotations

import torch

from nanokv.engine.llm import LLM
from nanokv.kv.monitor import CompressionMonitor
from nanokv.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [(7 * i + 3) % 997 + 2 for i in range(45)]  # 2 full 16-token blocks + a partial one


def _llm(**kw) -> LLM:
    return LLM("random:tiny-llama", num_gpu_blocks=64, block_size=16, max_num_batched_tokens=256, **kw)


def test_per_layer_plan_gives_layers_different_formats():
    llm = _llm(enable_compression=True, quantization_bitwidth={"default": 4, "layers": {"-1": 8}})
    c0, c1 = llm.engine.runner.kv_caches
    assert (c0.bits, c0.k.dtype, c0.k.shape[-1], c0.k_zero is not None) == (4, torch.uint8, 8, True)
    assert (c1.bits, c1.k.dtype, c1.k.shape[-1], c1.k_zero is None) == (8, torch.int8, 16, True)
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
        mon = CompressionMonitor(every=1).attach(llm.engine.runner.kv_caches)
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
        errs[name] = mon.snapshot()
    assert set(errs["fp"]) == {0, 1} and max(errs["fp"].values()) < 1e-6
    assert min(errs["int4"].values()) > 0.01
