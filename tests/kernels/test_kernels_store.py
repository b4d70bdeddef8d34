"""Triton store_kvcache vs the torch reference: bit-exact for every format (CPU: TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
pytest.importorskip("triton")

from nanokv.kernels import reference  # noqa: E402
from nanokv.kernels.triton_store import store_kvcache  # noqa: E402
from nanokv.kv.cache import allocate_layer_cache  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _unpack(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x & 15, x >> 4], dim=-1).int()


@pytest.mark.parametrize("bits,dtype", [(16, torch.float32), (16, torch.float16), (8, torch.float32),
                                        (8, torch.float16), (4, torch.float32), (4, torch.float16)])
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("heads", [0, 2])
def test_store_matches_reference(bits: int, dtype: torch.dtype, bs: int, heads: int) -> None:
    """heads: KV heads per program (0 = by format: int8 one, 16-bit all three; 2: a partial last group)."""
    g = torch.Generator().manual_seed(bits * 100 + bs)
    H, D, N, T = 3, 64, 6, 40
    want = allocate_layer_cache(bits, N, H, bs, D, dtype, DEV)
    got = allocate_layer_cache(bits, N, H, bs, D, dtype, DEV)
    slots = torch.randperm(N * bs, generator=g)[:T]
    slots[::5] = -1  # skipped tokens must leave the cache untouched
    if bits == 4:  # int4 stores into staging: the runner plans the step's staging slots first
        want.stage.plan(slots.numpy())
        got.stage.plan(slots.numpy())
    # K/V as slices of a fused qkv-like tensor: row stride != H * D
    qkv = (torch.randn(T, 3 * H, D, generator=g) * 4).to(dtype)
    k, v = qkv[:, H:2 * H], qkv[:, 2 * H:]
    reference.store_kvcache(k.to(DEV), v.to(DEV), want, slots.to(DEV))
    store_kvcache(k.to(DEV), v.to(DEV), got, slots.to(DEV), heads_per_program=heads)
    for name, a in want.tensors().items():  # codes, scales, zero points, staging
        b = got.tensors()[name]
        if bits == 4 and name in ("k", "v"):
            a, b = _unpack(a), _unpack(b)
        assert torch.equal(a, b), f"{name} differs (max {(a.float() - b.float()).abs().max().item()})"


def test_store_ties_and_constant_rows() -> None:
    """int8 (the one format quantized row by row in the store): exact half-way values (round half to
    even) and constant rows (scale from the 1e-8 floor)."""
    bits = 8
    H, D, bs = 2, 32, 8
    want = allocate_layer_cache(bits, 2, H, bs, D, torch.float32, DEV)
    got = allocate_layer_cache(bits, 2, H, bs, D, torch.float32, DEV)
    base = torch.arange(D, dtype=torch.float32) - D / 2  # integer grid: many x / scale land on .5
    k = torch.stack([torch.stack([base * 0.5, torch.full((D,), 3.0)]),
                     torch.stack([base * 1.5, base * 0.25])])  # [T=2, H, D]
    v = torch.flip(k, dims=[-1]).contiguous()
    slots = torch.tensor([3, 12])
    reference.store_kvcache(k.to(DEV), v.to(DEV), want, slots.to(DEV))
    store_kvcache(k.to(DEV), v.to(DEV), got, slots.to(DEV))
    assert torch.equal(want.k, got.k)
    assert torch.equal(want.k_scale, got.k_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_read_back_int8_is_the_stored_rows(dtype: torch.dtype) -> None:
    """read_back_int8 (fresh int8 prompts' flash operands) gives kv.quant's dequantization of the
    rows the store just wrote, bit for bit; rows of slot -1 are not written."""
    from nanokv.kernels.triton_store import read_back_int8
    from nanokv.kv.quant import dequantize_int8, quantize_int8
    g = torch.Generator().manual_seed(7)
    H, D, N, T, bs = 3, 64, 6, 40, 16
    cache = allocate_layer_cache(8, N, H, bs, D, torch.float16, DEV)
    slots = torch.randperm(N * bs, generator=g)[:T]
    slots[3] = -1
    k, v = ((torch.randn(T, H, D, generator=g) * 4).half().to(DEV) for _ in range(2))
    store_kvcache(k, v, cache, slots.to(DEV))
    rk, rv = read_back_int8(cache, slots.to(DEV), dtype)
    keep = slots >= 0
    for x, r in ((k, rk), (v, rv)):
        want = dequantize_int8(*quantize_int8(x[keep]), dtype)
        assert torch.equal(r[keep], want)
        assert not torch.equal(r[keep], x[keep].to(dtype))  # really the int8 values, not the inputs
