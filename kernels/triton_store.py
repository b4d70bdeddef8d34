"""store_kvcache: write each new token's K/V rows into its cache slot, quantizing on the way in (int8).

int4 rows go unquantized to their block's full-precision staging slot; the block is quantized as a
whole once it fills (nanokv.kv.blockquant, after the step's attention), never row by row here.

Grid (T, head groups): a program stores one token's K/V rows for a group of its KV heads as a
[heads, D/2] x 2 tile (16-bit: all heads; int8: one head per one-warp program, since the
quantizing store is a latency chain of loads, a max, IEEE divisions and stores, and at a decode
step's few tokens a program per token left most of the GPU idle). Slot -1 means
"don't store" (padding, or a token whose KV is already cached). Quantization matches
nanokv.kv.quant bit for bit: IEEE division (div_rn, not the fast approximate one), fp16 rounding
of scale and zero, round-half-to-even like torch.round, and scales that underflow to 0 stored as 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton_kvtile import kv_meta_args, next_pow2
from nanokv.kv.cache import Int4KV, Int8KV, LayerKV, check_layout


@triton.jit
def _round_half_even(y):
    """torch.round semantics, exact for any float32 (floor and y - floor(y) are exact)."""
    f = tl.floor(y)
    frac = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _safe_scale(scale):
    """fp16 scales that underflowed to 0 (constant or all-zero rows) become 1.0, as in kv.quant:
    codes 0, and the row decodes to 0 (int8) or to its constant (int4)."""
    return tl.where(scale == 0.0, 1.0, scale).to(tl.float16)


@triton.jit
def _rne_clip(y, lo, hi):
    return tl.minimum(tl.maximum(_round_half_even(y), lo), hi)


@triton.jit
def _store_rows(x_ptr, stride_xt, stride_xh, c_ptr, s_ptr, z_ptr, t, crow, stride_cd, srow, offs_h, h_ok, offs_d,
                m2, DH: tl.constexpr, BITS: tl.constexpr):
    """Quantize/store the [H, D] rows of token t. crow: [BLOCK_H] code-row offsets, stride_cd: the
    codes' dim stride (1, or bs for int8 values, stored dims-major); srow: scale offsets."""
    xr = x_ptr + t.to(tl.int64) * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x_lo = tl.load(xr, mask=m2, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_DH], dims [0, D/2)
    x_hi = tl.load(xr + DH, mask=m2, other=0.0).to(tl.float32)  # dims [D/2, D)
    cr = c_ptr + crow[:, None] + offs_d[None, :] * stride_cd
    if BITS == 8:
        amax = tl.maximum(tl.max(tl.abs(x_lo), axis=1), tl.max(tl.abs(x_hi), axis=1))
        scale = _safe_scale(tl.div_rn(amax, 127.0).to(tl.float16))
        sf = scale.to(tl.float32)[:, None]
        c_lo = _rne_clip(tl.div_rn(x_lo, sf), -127.0, 127.0)
        c_hi = _rne_clip(tl.div_rn(x_hi, sf), -127.0, 127.0)
        tl.store(cr, c_lo.to(tl.int8), mask=m2)
        tl.store(cr + DH * stride_cd, c_hi.to(tl.int8), mask=m2)
        tl.store(s_ptr + srow, scale, mask=h_ok)
    else:
        tl.store(cr, x_lo.to(c_ptr.dtype.element_ty), mask=m2)
        tl.store(cr + DH * stride_cd, x_hi.to(c_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _store_kernel(
    k_ptr, v_ptr, slot_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, stage_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cn, stride_ch, stride_cs, stride_vs, stride_vd, stride_sn, stride_sh,
    H, DH: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, STAGED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DH: tl.constexpr,
):
    # STAGED (int4): kc/vc are the staging tensors, and a cache slot goes to its block's staging slot
    # (stage_ptr: [N] block -> slot, -1 = none: not stored), same offset in the block
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if STAGED:
        st = tl.load(stage_ptr + tl.maximum(slot, 0) // BS, mask=slot >= 0, other=-1).to(tl.int64)
        slot = tl.where((slot >= 0) & (st >= 0), st * BS + slot % BS, -1)
    keep = slot >= 0
    blk = tl.where(keep, slot // BS, 0)
    off = tl.where(keep, slot % BS, 0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_DH)
    h_ok = offs_h < tl.where(keep, H, 0)  # [BLOCK_H]; all False for slot -1
    m2 = h_ok[:, None] & (offs_d[None, :] < DH)
    head = blk * stride_cn + offs_h * stride_ch  # [BLOCK_H] int64; K and V blocks have the same n/h strides
    srow = blk * stride_sn + offs_h * stride_sh + off
    _store_rows(k_ptr, stride_kt, stride_kh, kc_ptr, ks_ptr, kz_ptr, t, head + off * stride_cs, 1, srow, offs_h,
                h_ok, offs_d, m2, DH, BITS)
    _store_rows(v_ptr, stride_vt, stride_vh, vc_ptr, vs_ptr, vz_ptr, t, head + off * stride_vs, stride_vd, srow,
                offs_h, h_ok, offs_d, m2, DH, BITS)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slot_mapping: torch.Tensor,
                  heads_per_program: int = 0) -> None:
    """k, v: [T, H, D] (last dim contiguous); slot_mapping: [T] int64, -1 = skip. heads_per_program:
    KV heads one program stores (0 = by format: 1 for int8, all for 16-bit rows)."""
    T, H, D = k.shape
    if T == 0:
        return
    assert D % 2 == 0 and k.stride(-1) == 1 and v.stride(-1) == 1
    check_layout(cache)  # (K and V share block and head strides: one `head` offset serves both)
    ks, vs, kz, vz = kv_meta_args(cache)
    bits = cache.bits if cache.quantized else 16
    kc, vc, stage_of = cache.k, cache.v, slot_mapping  # (stage_of: unused unless staged)
    staged = False
    if isinstance(cache, Int4KV):
        # int4: rows go to their block's full-precision staging slot, laid out like a 16-bit cache
        # ([S, H, bs, D], slot = stage slot * bs + offset, looked up in the kernel: as torch ops it was
        # five small kernels per layer and step); nanokv.kv.blockquant quantizes full blocks
        kc, vc, bits, stage_of, staged = cache.k_stage, cache.v_stage, 16, cache.stage.stage_of, True
    hb = heads_per_program or (1 if bits == 8 else H)
    block_h = next_pow2(min(hb, H))
    _store_kernel[(T, triton.cdiv(H, block_h))](
        k, v, slot_mapping, kc, vc, ks, vs, kz, vz, stage_of,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(2), vc.stride(3),
        ks.stride(0) if bits < 16 else 0, ks.stride(1) if bits < 16 else 0,
        H, DH=D // 2, BS=cache.block_size, BITS=bits, STAGED=staged,
        BLOCK_H=block_h, BLOCK_DH=max(16, next_pow2(D // 2)), num_warps=1 if block_h == 1 else 4,
    )


@triton.jit
def _readback_kernel(slot_ptr, c_ptr, s_ptr, o_ptr, stride_cn, stride_ch, stride_cs, stride_cd, stride_sn, stride_sh,
                     stride_ot, stride_oh, H, D: tl.constexpr, BS: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (T,): out[t] = codes x scale of the int8 rows at slot t ([H, D], fp32 product rounded
    once to out's dtype, as kv.quant.dequantize_int8). Slot -1 rows are left unwritten."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        m2 = (offs_h < H)[:, None] & (offs_d < D)[None, :]
        blk, off = slot // BS, slot % BS
        row = blk * stride_cn + offs_h[:, None] * stride_ch + off * stride_cs
        c = tl.load(c_ptr + row + offs_d[None, :] * stride_cd, mask=m2, other=0).to(tl.float32)
        s = tl.load(s_ptr + blk * stride_sn + offs_h * stride_sh + off, mask=offs_h < H, other=0.0)
        o = c * s.to(tl.float32)[:, None]
        tl.store(o_ptr + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=m2)


def read_back_int8(cache: Int8KV, slot_mapping: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 K and V rows stored at slot_mapping [T], dequantized: [T, H, D] each in dtype."""
    T, H, D = int(slot_mapping.shape[0]), cache.num_kv_heads, int(cache.k.shape[-1])
    outs = []
    for c, s in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        o = torch.empty((T, H, D), dtype=dtype, device=c.device)
        if T:
            _readback_kernel[(T,)](slot_mapping, c, s, o, c.stride(0), c.stride(1), c.stride(2), c.stride(3),
                                   s.stride(0), s.stride(1), o.stride(0), o.stride(1), H, D=D, BS=cache.block_size,
                                   BLOCK_H=next_pow2(H), BLOCK_D=next_pow2(D), num_warps=4)
        outs.append(o)
    return outs[0], outs[1]
