"""The CUDA C++ int4 decode (nanokv.kernels.cuda_decode_int4) against the torch reference.

GPU only: the kernel is compiled by NVRTC and has no interpreter, so on CPU these tests skip (the
Triton kernels it stands in for are tested under TRITON_INTERPRET=1 in test_kernels_attention).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the CUDA int4 decode needs a GPU (no interpreter)", allow_module_level=True)

from test_kernels_attention import build_batch, check, check_twice_merged, small_cfg  # noqa: E402

from nanokv.kernels import reference  # noqa: E402
from nanokv.kernels.cuda_decode_int4 import supported  # noqa: E402
from nanokv.kernels.triton_backend import TritonBackend  # noqa: E402
from nanokv.kernels.triton_config import TritonConfig  # noqa: E402

LENS = [1, 17, 40, 130, 301, 1000]


def cuda_cfg(splits: int, stages: int = 2, by_length: bool = True, tiles: int = 2) -> TritonConfig:
    cfg = small_cfg(splits=splits)
    cfg.quant_cuda4 = True
    cfg.quant_cuda4_stages = stages
    cfg.quant_cuda4_by_length = by_length
    cfg.quant_cuda4_tiles = tiles
    return cfg


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G,bs,splits", [(2, 16, 1), (2, 16, 8), (2, 32, 3), (1, 16, 5), (3, 16, 4), (4, 32, 2),
                                         (8, 16, 2), (2, 64, 7)])
def test_cuda_int4_decode(dtype: torch.dtype, G: int, bs: int, splits: int, stages: int) -> None:
    """Holes, split-K with empty splits, a one-token context, each sequence's newest block staged;
    twice, since the in-kernel merge must leave its counters at zero."""
    cache, md, q = build_batch(4, dtype, bs, 2, G, 128, [], LENS, holes=True, seed=G * bs + splits)
    assert supported(q, q, cache)
    check_twice_merged(cache, md, q, cuda_cfg(splits, stages))


@pytest.mark.parametrize("tiles", [1, 2, 4])
@pytest.mark.parametrize("G,bs,splits", [(2, 32, 3), (2, 64, 7), (4, 64, 1), (2, 128, 5)])
def test_cuda_int4_decode_tiles_per_step(G: int, bs: int, splits: int, tiles: int) -> None:
    """1, 2 or 4 tiles per loop step (fewer where the block is smaller) compute the same."""
    cache, md, q = build_batch(4, torch.bfloat16, bs, 2, G, 128, [], LENS, holes=True, seed=G * bs + tiles)
    check_twice_merged(cache, md, q, cuda_cfg(splits, tiles=tiles))


@pytest.mark.parametrize("G,bs,splits", [(2, 16, 8), (3, 32, 1)])
def test_cuda_int4_decode_in_row_order(G: int, bs: int, splits: int) -> None:
    """The grid in row order (quant_cuda4_by_length off) computes the same."""
    cache, md, q = build_batch(4, torch.float16, bs, 2, G, 128, [], LENS, holes=True, seed=G + bs)
    check_twice_merged(cache, md, q, cuda_cfg(splits, by_length=False))


def test_cuda_int4_fp16_query_on_bf16_cache() -> None:
    """As in the engine: the RoPE kernel hands quantized layers an fp16 q, the model (and staging) is bf16."""
    cache, md, q = build_batch(4, torch.bfloat16, 16, 8, 2, 128, [], LENS, holes=True, seed=3)
    q = q.half()
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    assert supported(q, out, cache)
    TritonBackend(cuda_cfg(4)).paged_attention(q, cache, md, 128 ** -0.5, out=out)
    ref = reference.paged_attention(q.float(), cache, md, 128 ** -0.5)
    assert not out.isnan().any()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-3


@pytest.mark.parametrize("bs", [16, 32])
def test_cuda_int4_staged_before_newest_block(bs: int) -> None:
    """A block staged before a sequence's newest (tests stage at will; decode steps do not) is read
    from staging for the whole split, as in the Triton kernels."""
    cache, md, q = build_batch(4, torch.float16, bs, 2, 2, 128, [], [70, 100], holes=False, seed=5)
    blk = int(md.block_tables[1, 2])
    rows = blk * bs + torch.arange(bs)
    cache.stage.plan(rows.numpy())
    k, v = (torch.randn(2, bs, 2, 128) * 3).half().cuda()
    reference.store_kvcache(k, v, cache, rows.cuda())
    check(cache, md, q, cuda_cfg(2))


def test_cuda_int4_mixed_step() -> None:
    """Prefills first, then decodes: the decode part is a slice of q and out."""
    cache, md, q = build_batch(4, torch.float16, 16, 2, 2, 128, [(0, 20), (32, 9)], [5, 77, 300], holes=True, seed=7)
    check(cache, md, q, cuda_cfg(3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bs,splits", [(16, 1), (16, 8), (32, 3)])
def test_cuda_int4_decode_fills_completed_blocks(dtype: torch.dtype, bs: int, splits: int) -> None:
    """Given the step's slots, the kernel quantizes each staged block a decode token completes (its
    last slot) into the pool: bit for bit what the fill kernel after attention writes, and nothing else."""
    from dataclasses import replace

    from nanokv.kernels.triton_blockquant import quantize_filled_graphsafe
    lens = [bs, 2 * bs, 3 * bs + 1, 5 * bs, 7, 9 * bs]  # four complete their newest block
    cache, md, q = build_batch(4, dtype, bs, 8, 2, 128, [], lens, holes=True, seed=bs + splits)
    pool = cache.block_fields
    want = replace(cache, **{n: getattr(cache, n).clone() for n in pool})
    quantize_filled_graphsafe(want, md.slot_mapping)
    before = {n: getattr(cache, n).clone() for n in pool}
    assert supported(q, q, cache) and not md.fills_quantized
    check(cache, md, q, cuda_cfg(splits))  # the attention is still right
    assert md.fills_quantized  # (after_attention then skips its own fill launch)
    for n in pool:
        assert torch.equal(getattr(cache, n), getattr(want, n)), n
        assert not torch.equal(getattr(cache, n), before[n]), n  # (there was something to fill)


def test_engine_int4_fill_in_the_decode_kernel_changes_nothing(monkeypatch) -> None:
    """A bf16 Qwen3-0.6B-shaped model (random weights) under CUDA graphs: with the decode kernel
    filling blocks (quant_cuda4_fill) and with the fill kernel after attention, the same greedy
    tokens and the same int4 cache, bit for bit."""
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams
    prompts = [[(7 * i + 3 * j) % 5000 + 2 for i in range(20 + 9 * j)] for j in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    toks, caches = {}, {}
    for flag in ("0", "1"):
        llm = LLM("random:qwen3-0.6b", kernel_options=f"quant_cuda4_fill={flag}", num_gpu_blocks=64, block_size=16,
                  max_model_len=256, device="cuda", dtype="bfloat16", enable_compression=True, quantization_bitwidth=4)
        assert llm.engine.runner.backend.config.quant_cuda4_fill == (flag == "1")
        toks[flag] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        caches[flag] = [[t.clone() for t in (c.k, c.v, c.k_scale, c.k_zero, c.v_scale, c.v_zero)]
                        for c in llm.engine.runner.kv_caches]
        del llm
    assert toks["0"] == toks["1"]
    for a, b in zip(caches["0"], caches["1"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
