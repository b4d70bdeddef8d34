"""KV formats: quant/dequant round-trip bounds, int4 nibble layout, byte accounting, simulation fidelity."""

from __future__ import annotations

import pytest
import torch

from nanokv.kv import quant
from nanokv.kv.cache import allocate_layer_cache, bytes_per_block
from nanokv.kv.fakequant import FakeQuant, fq_lastdim


def _rows(seed: int = 0, n: int = 256, d: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, d, generator=g)
    x[..., 5] *= 8.0  # an outlier channel, as real keys have
    return x


def test_int8_roundtrip_error_is_within_half_a_step():
    x = _rows()
    codes, scale = quant.quantize_int8(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == x.shape[:-1]
    err = (quant.dequantize_int8(codes, scale, torch.float32) - x).abs()
    # half a quantization step, plus float16 rounding of the scale (relative 2^-11) times 127 steps
    bound = scale.float().unsqueeze(-1) * (0.5 + 127 * 2.0**-11) + 1e-6
    assert bool((err <= bound).all())
    rel = (err.pow(2).sum() / x.pow(2).sum()).sqrt()
    assert rel < 0.02


def test_int4_roundtrip_error_is_within_half_a_step():
    x = _rows(1)
    packed, scale, zero = quant.quantize_int4(x)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == x.shape[-1] // 2
    err = (quant.dequantize_int4(packed, scale, zero, torch.float32) - x).abs()
    # half a step, plus the float16 zero point's rounding (relative 2^-11 of |min|)
    bound = scale.float().unsqueeze(-1) * (0.5 + 15 * 2.0**-11) + zero.float().abs().unsqueeze(-1) * 2.0**-11
    assert bool((err <= bound + 1e-6).all())
    rel = (err.pow(2).sum() / x.pow(2).sum()).sqrt()
    assert 0.02 < rel < 0.25


def test_int4_packs_dim_d_low_and_d_plus_half_high():
    D = 8
    x = torch.arange(D, dtype=torch.float32).repeat(2, 1)  # min 0, max 7 -> codes 0..15 spaced by ~2.14
    x[1] = torch.tensor([0.0, 15, 1, 14, 2, 13, 3, 12]) * (7 / 15)
    packed, scale, zero = quant.quantize_int4(x)
    codes = torch.round((x - zero.float()[:, None]) / scale.float()[:, None]).to(torch.uint8)
    for d in range(D // 2):
        assert torch.equal(packed[:, d] & 0xF, codes[:, d])
        assert torch.equal(packed[:, d] >> 4, codes[:, d + D // 2])


@pytest.mark.parametrize("bits", [8, 4])
def test_degenerate_rows_do_not_divide_by_zero(bits):
    x = torch.zeros(2, 1, 16)
    x[1] = 3.25  # a constant row: zero range
    if bits == 8:
        c, s = quant.quantize_int8(x)
        y = quant.dequantize_int8(c, s, torch.float32)
        assert torch.equal(y[0], x[0]) and torch.allclose(y[1], x[1], rtol=1e-2)
    else:
        c, s, z = quant.quantize_int4(x)
        y = quant.dequantize_int4(c, s, z, torch.float32)
        assert torch.equal(y, x)
    assert bool(torch.isfinite(y).all())


def test_bytes_per_block_counts_codes_and_scales():
    H, bs, D = 3, 16, 64
    n = H * bs
    assert bytes_per_block(16, H, bs, D, torch.bfloat16) == 2 * n * D * 2
    assert bytes_per_block(16, H, bs, D, torch.float32) == 2 * n * D * 4
    assert bytes_per_block(8, H, bs, D, torch.bfloat16) == 2 * (n * D + n * 2)  # int8 + fp16 scale
    # int4: codes, K fp16 scale + zero per (head, channel), V fp16 scale + zero per (token, head)
    assert bytes_per_block(4, H, bs, D, torch.bfloat16) == 2 * (n * D // 2) + H * D * 4 + n * 4
    for bits in (16, 8, 4):
        c = allocate_layer_cache(bits, 2, H, bs, D, torch.bfloat16, "cpu")
        tensors = [getattr(c, n) for n in c.block_fields]  # codes, scales, zero points (not int4 staging)
        assert sum(t.numel() * t.element_size() for t in tensors) == 2 * bytes_per_block(bits, H, bs, D,
                                                                                         torch.bfloat16)
    bf16 = bytes_per_block(16, H, bs, D, torch.bfloat16)
    assert bytes_per_block(8, H, bs, D, torch.bfloat16) / bf16 <= 0.53  # target: INT8 <= 53% of bf16
    assert bytes_per_block(4, H, 32, D, torch.bfloat16) / bytes_per_block(16, H, 32, D, torch.bfloat16) <= 0.30
    assert bytes_per_block(4, H, bs, D, torch.bfloat16) / bf16 <= 0.33  # 16-token blocks: 4 + 2 bits / value


@pytest.mark.parametrize("bits", [8, 4])
def test_fake_quant_matches_the_reference_format(bits):
    x = _rows(2)
    if bits == 8:
        ref = quant.dequantize_int8(*quant.quantize_int8(x), torch.float32)
    else:
        ref = quant.dequantize_int4(*quant.quantize_int4(x), torch.float32)
    assert torch.equal(fq_lastdim(x, bits), ref)
    pos = torch.arange(x.shape[0])
    k, v = FakeQuant(bits, bits).apply(x, x, pos, torch.zeros_like(pos), 16)
    assert torch.equal(k, ref) and torch.equal(v, ref)


def test_fake_quant_sinks_and_per_channel_keys():
    x = _rows(3, n=32)
    pos = torch.arange(32)
    seq = torch.zeros(32, dtype=torch.long)
    k, v = FakeQuant(4, 4, sink_tokens=16).apply(x, x, pos, seq, 16)
    assert torch.equal(k[:16], x[:16]) and not torch.equal(k[16:], x[16:])
    kc, _ = FakeQuant(4, 4, k_per_channel=True).apply(x, x, pos, seq, 16)
    err_chan = (kc - x).pow(2).sum() / x.pow(2).sum()
    err_tok = (fq_lastdim(x, 4) - x).pow(2).sum() / x.pow(2).sum()
    assert err_chan < err_tok  # a fixed outlier channel is what per-channel scales are for
