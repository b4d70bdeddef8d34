"""Hybrid sparsity's demotion copy as one Triton launch per layer: INT8 pool blocks -> INT4 store slots.

nanokv.kv.demote.DemotedBlocks.write (torch, the reference and the CPU path) dequantizes the blocks
and re-quantizes them with nanokv.kv.quant.quantize_int4: about twenty small torch operations per
layer, so a step that demotes a few blocks of a 28-layer model paid ~20 ms of launches on the GPU
before its forward pass. Here grid (n, H, 2): one program per (block, KV head, keys or values)
reads the [bs, D] int8 rows and their scales, and writes the packed codes, scale and zero of its
store slot. Bit for bit kv.quant: the fp32 product code * scale, IEEE division (div_rn), fp16
rounding of scale and zero, round-half-even codes, underflowed scales stored as 1.0.

Shapes (nanokv.kv.cache.Int8KV, nanokv.kv.demote.DemotedBlocks):
    src k, v        int8    [N, H, bs, D]   (v dims-major in memory: any strides are taken)
    src scales      float16 [N, H, bs]
    dst k, v        uint8   [M, H, bs, D/2] dim d low nibble, d + D/2 high nibble
    dst scale, zero float16 [M, H, bs]
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton_blockquant import row_int4
from nanokv.kernels.triton_kvtile import next_pow2
from nanokv.kv.demote import HybridInt8KV


@triton.jit
def _mul_rn(a, b, EXACT: tl.constexpr):
    """a * b rounded on its own, as torch's separate product: on the GPU, `mul.rn` keeps ptxas from
    contracting the product and the following subtraction into one fma (which would round once
    where torch rounds twice); the interpreter never contracts."""
    if EXACT:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return a * b


@triton.jit
def _demote_kernel(
    ids_ptr, slots_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, dk_ptr, dv_ptr, dks_ptr, dkz_ptr, dvs_ptr, dvz_ptr,
    s_kn, s_kh, s_kt, s_kd, s_vn, s_vh, s_vt, s_vd, s_sn, s_sh, s_dn, s_dh, s_mn, s_mh,
    BS: tl.constexpr, DH: tl.constexpr, BLOCK_DH: tl.constexpr, EXACT: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(ids_ptr + i).to(tl.int64)
    j = tl.load(slots_ptr + i).to(tl.int64)
    offs_t = tl.arange(0, BS)
    offs_d = tl.arange(0, BLOCK_DH)
    d_ok = offs_d < DH
    m2 = (offs_t < BS)[:, None] & d_ok[None, :]  # [BS, BLOCK_DH]
    if tl.program_id(2) == 0:
        c_ptr, s_ptr, o_ptr, os_ptr, oz_ptr = kc_ptr, ks_ptr, dk_ptr, dks_ptr, dkz_ptr
        row = b * s_kn + h * s_kh + offs_t[:, None] * s_kt + offs_d[None, :] * s_kd
        hi_off = DH * s_kd
    else:
        c_ptr, s_ptr, o_ptr, os_ptr, oz_ptr = vc_ptr, vs_ptr, dv_ptr, dvs_ptr, dvz_ptr
        row = b * s_vn + h * s_vh + offs_t[:, None] * s_vt + offs_d[None, :] * s_vd
        hi_off = DH * s_vd
    sc = tl.load(s_ptr + b * s_sn + h * s_sh + offs_t).to(tl.float32)  # [BS] the int8 rows' scales
    x_lo = _mul_rn(tl.load(c_ptr + row, mask=m2, other=0).to(tl.float32), sc[:, None], EXACT)  # [0, D/2)
    x_hi = _mul_rn(tl.load(c_ptr + row + hi_off, mask=m2, other=0).to(tl.float32), sc[:, None], EXACT)
    packed, scale, zero = row_int4(x_lo, x_hi, d_ok, False)
    tl.store(o_ptr + j * s_dn + h * s_dh + offs_t[:, None] * DH + offs_d[None, :], packed.to(tl.uint8), mask=m2)
    meta = j * s_mn + h * s_mh + offs_t
    tl.store(os_ptr + meta, scale)
    tl.store(oz_ptr + meta, zero)


def demote_blocks(cache: HybridInt8KV, block_ids: torch.Tensor, slots: torch.Tensor) -> None:
    """One layer: its int8 blocks `block_ids` [n] (int64, on the device) re-quantized to int4 into its
    store slots `slots` [n] (distinct; DemotionStore.demote orders repeats). DemotedBlocks.write's
    contract, one launch."""
    n = int(block_ids.shape[0])
    if n == 0:
        return
    st = cache.demoted
    _, H, bs, D = cache.k.shape
    # internal layout contract: DemotedBlocks.zeros allocates the store contiguous; pool scales are
    assert st.k.is_contiguous() and st.v.is_contiguous() and cache.k_scale.stride() == cache.v_scale.stride()
    assert st.k_scale.stride() == st.v_scale.stride() == st.k_zero.stride() == st.v_zero.stride()
    assert cache.k_scale.stride(2) == 1 and st.k_scale.stride(2) == 1 and bs & (bs - 1) == 0
    _demote_kernel[(n, H, 2)](
        block_ids, slots, cache.k, cache.v, cache.k_scale, cache.v_scale, st.k, st.v,
        st.k_scale, st.k_zero, st.v_scale, st.v_zero,
        *cache.k.stride(), *cache.v.stride(), cache.k_scale.stride(0), cache.k_scale.stride(1),
        st.k.stride(0), st.k.stride(1), st.k_scale.stride(0), st.k_scale.stride(1),
        BS=bs, DH=D // 2, BLOCK_DH=max(16, next_pow2(D // 2)),
        EXACT=cache.k.is_cuda and os.environ.get("TRITON_INTERPRET") != "1", num_warps=4 if bs <= 32 else 8,
    )
