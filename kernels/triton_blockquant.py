"""int4 quantize-on-fill as one Triton kernel with no host sync: CUDA-graph safe.

nanokv.kv.blockquant.quantize_filled (torch, the eager path and the reference) quantizes the blocks
a step filled from the host's list of them, a data-dependent count. Here the list is derived on
the device from the step's slot mapping instead: a token whose slot is the last of its block
(slot % bs == bs - 1) filled that block, exactly the blocks StageTable.plan lists. Grid (T, H, 2):
one program per (step token, KV head, keys or values); programs of tokens that fill nothing (and
padding rows, slot -1) skip all work, so the launch has a fixed shape for a fixed T (a captured
decode graph's batch bucket) and costs little: in a decode step about 1 in bs sequences fills a block.

Bit for bit nanokv.kv.quant: keys per channel over the block's bs tokens, values per token, both
asymmetric; IEEE division (div_rn), fp16 rounding of scale and zero, round-half-even, underflowed
scales stored as 1.0 (triton_store's helpers).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton_config import TritonConfig, apply_overrides, overrides
from nanokv.kernels.triton_kvtile import next_pow2
from nanokv.kernels.triton_store import _rne_clip, _safe_scale
from nanokv.kv.cache import Int4KV


@triton.jit
def div_by_recip(d, s, y):
    """d / s rounded to nearest even, as tl.div_rn, given y = div_rn(1, s): a product and two fused
    corrections, no slow path. The first correction leaves the quotient within one ulp, and from a
    quotient within one ulp and the correctly rounded reciprocal, one more step gives the correctly
    rounded quotient (Markstein); each remainder d - q s is exact in an fma. Holds for normal
    operands and quotients (codes come from quotients near 0.5 .. 14.5; a zero d gives 0).
    div_rn itself takes a slow path in a warp where any lane's operands need it, a zero dividend
    among them: in the fill kernel's blocks, every channel's minimum (Nsight Compute, H200)."""
    q = d * y
    q = tl.fma(tl.fma(-q, s, d), y, q)
    return tl.fma(tl.fma(-q, s, d), y, q)


@triton.jit
def _codes(x, lo, scale, RECIP: tl.constexpr):
    """x [BS, BLOCK_DH] fp32, lo and scale broadcastable fp16 -> codes 0..15 as int32; RECIP: divide
    by the scale's reciprocal with exact corrections (div_by_recip: the same codes)."""
    d = x - lo.to(tl.float32)
    s = scale.to(tl.float32)
    if RECIP:
        q = div_by_recip(d, s, tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s))
    else:
        q = tl.div_rn(d, s)
    return _rne_clip(q, 0.0, 15.0).to(tl.int32)


@triton.jit
def row_int4(x_lo, x_hi, d_ok, RECIP: tl.constexpr):
    """Rows [BS, BLOCK_DH] x 2 (dims [0, D/2) and [D/2, D), fp32; d_ok masks the padding dims) ->
    packed codes [BS, BLOCK_DH] int32 (low nibble d, high nibble d + D/2), fp16 scale and zero [BS]:
    one asymmetric range per row, as kv.quant.quantize_int4."""
    big = float("inf")
    lo = tl.minimum(tl.min(tl.where(d_ok[None, :], x_lo, big), axis=1),
                    tl.min(tl.where(d_ok[None, :], x_hi, big), axis=1))  # [BS]
    hi = tl.maximum(tl.max(tl.where(d_ok[None, :], x_lo, -big), axis=1),
                    tl.max(tl.where(d_ok[None, :], x_hi, -big), axis=1))
    scale = _safe_scale(tl.div_rn(hi - lo, 15.0).to(tl.float16))
    zero = lo.to(tl.float16)
    z, sc = zero[:, None], scale[:, None]
    return _codes(x_lo, z, sc, RECIP) | (_codes(x_hi, z, sc, RECIP) << 4), scale, zero


@triton.jit
def _fill_quant_kernel(
    slot_ptr, stage_ptr, kst_ptr, vst_ptr, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
    stride_stn, stride_sth, stride_cn, stride_ch, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_vt, stride_vd, BS: tl.constexpr, DH: tl.constexpr, BLOCK_DH: tl.constexpr, RECIP: tl.constexpr,
):
    # stride_vt, stride_vd: the value codes' token and byte strides (values dims-major, nanokv.kv.cache)
    # grid (T, H, 2): the keys (axis 2 = 0) and the values (1) of a block are separate programs, so
    # each program's chain of dependent loads, reductions and stores is half as long
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    fills = (slot >= 0) & (slot % BS == BS - 1)
    blk = tl.where(fills, slot // BS, 0)
    st = tl.load(stage_ptr + blk, mask=fills, other=-1).to(tl.int64)
    ok = fills & (st >= 0)  # a filled block is always staged (StageTable.plan): guard anyway
    if ok:  # most programs (tokens that fill no block, padding rows) end here
        offs_t = tl.arange(0, BS)
        offs_d = tl.arange(0, BLOCK_DH)
        d_ok = offs_d < DH
        m2 = (offs_t < BS)[:, None] & d_ok[None, :]  # [BS, BLOCK_DH]
        src = st * stride_stn + h * stride_sth + offs_t[:, None] * (2 * DH) + offs_d[None, :]
        crow = blk * stride_kn + h * stride_kh + offs_t[:, None] * DH + offs_d[None, :]  # packed codes [bs, D/2]
        if tl.program_id(2) == 0:  # keys: one scale/zero per channel over the block's tokens (KIVI)
            k_lo = tl.load(kst_ptr + src, mask=m2, other=0.0).to(tl.float32)  # dims [0, D/2)
            k_hi = tl.load(kst_ptr + src + DH, mask=m2, other=0.0).to(tl.float32)  # dims [D/2, D)
            lo_l, lo_h = tl.min(k_lo, axis=0), tl.min(k_hi, axis=0)  # [BLOCK_DH]
            sc_l = _safe_scale(tl.div_rn(tl.max(k_lo, axis=0) - lo_l, 15.0).to(tl.float16))
            sc_h = _safe_scale(tl.div_rn(tl.max(k_hi, axis=0) - lo_h, 15.0).to(tl.float16))
            z_l, z_h = lo_l.to(tl.float16), lo_h.to(tl.float16)
            packed = (_codes(k_lo, z_l[None, :], sc_l[None, :], RECIP)
                      | (_codes(k_hi, z_h[None, :], sc_h[None, :], RECIP) << 4))
            tl.store(kc_ptr + crow, packed.to(tl.uint8), mask=m2)
            meta = blk * stride_cn + h * stride_ch + offs_d  # [BLOCK_DH] into [N, H, D]
            tl.store(ks_ptr + meta, sc_l, mask=d_ok)
            tl.store(ks_ptr + meta + DH, sc_h, mask=d_ok)
            tl.store(kz_ptr + meta, z_l, mask=d_ok)
            tl.store(kz_ptr + meta + DH, z_h, mask=d_ok)
        else:  # values: one scale/zero per token over its D dims
            v_lo = tl.load(vst_ptr + src, mask=m2, other=0.0).to(tl.float32)
            v_hi = tl.load(vst_ptr + src + DH, mask=m2, other=0.0).to(tl.float32)
            packed, sc_v, z_v = row_int4(v_lo, v_hi, d_ok, RECIP)
            vrow = blk * stride_kn + h * stride_kh + offs_t[:, None] * stride_vt + offs_d[None, :] * stride_vd
            tl.store(vc_ptr + vrow, packed.to(tl.uint8), mask=m2)
            vmeta = blk * stride_vn + h * stride_vh + offs_t  # [BS] into [N, H, bs]
            tl.store(vs_ptr + vmeta, sc_v)
            tl.store(vz_ptr + vmeta, z_v)


def _recip_default() -> bool:
    """TritonConfig.fill_recip with this process's kernel options: the fill is launched by
    compute_service.kv_hooks, which has no handle on the backend's config."""
    return _recip_for(overrides())


@functools.cache
def _recip_for(spec: str) -> bool:
    return apply_overrides(TritonConfig(), spec).fill_recip


def prefill_fill_warps() -> int:
    """Warps per program of a prefill step's fill (one program per filled block, head and K or V):
    1 with the reciprocal codes, 8 with the division (timings at TritonConfig.fill_recip)."""
    return 1 if _recip_default() else 8


def quantize_filled_graphsafe(cache: Int4KV, slot_mapping: torch.Tensor, num_warps: int = 0,
                              recip: bool | None = None) -> None:
    """After the step's attention: quantize every block whose last slot this step wrote, from its
    staging slot into the pool. slot_mapping: [T] int64 (the step's; -1 = not stored). num_warps per
    program, 0 = by block size. recip: codes through div_by_recip (the same codes; None =
    TritonConfig.fill_recip)."""
    T, H, D = int(slot_mapping.shape[0]), cache.num_kv_heads, cache.k_stage.shape[-1]
    bs = cache.block_size
    if T == 0:
        return
    assert cache.k_stage.is_contiguous() and cache.k.is_contiguous() and bs & (bs - 1) == 0
    _fill_quant_kernel[(T, H, 2)](
        slot_mapping, cache.stage.stage_of, cache.k_stage, cache.v_stage, cache.k, cache.v,
        cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero,
        cache.k_stage.stride(0), cache.k_stage.stride(1), cache.k_scale.stride(0), cache.k_scale.stride(1),
        cache.k.stride(0), cache.k.stride(1), cache.v_scale.stride(0), cache.v_scale.stride(1),
        cache.v.stride(2), cache.v.stride(3),
        BS=bs, DH=D // 2, BLOCK_DH=max(16, next_pow2(D // 2)), RECIP=_recip_default() if recip is None else recip,
        num_warps=num_warps or (4 if bs <= 64 else 8),
    )
