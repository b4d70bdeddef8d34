"""Shared Triton helpers: read one tile of paged K/V and fold the dequantization into the math.

Both attention kernels (decode and prefill) walk a sequence's context in tiles of BLOCK_N tokens.
A tile may span several cache blocks (small block sizes) or part of one (large ones): each token
finds its physical block through the block table, so any power-of-2 block size works.

Head dims are handled as two halves [0, D/2) and [D/2, D): that is what the int4 format packs
into the low and high nibbles, and using it for every format keeps one code path. Quantized
codes are never expanded to a full-precision copy of the cache: K scales multiply the score
columns after the dot and int4 zero points add a rank-1 term:
  q . (s*c + z) = s * (q . c) + z * sum(q)
V codes are dequantized in registers, tile by tile (see pv_accumulate).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def compute_dtype(q_dtype: torch.dtype, bits: int) -> tl.dtype:
    """Operand dtype of the two products. Quantized caches use fp16 even for bf16 models: int8 and
    int4 codes convert to fp16 exactly and cheaply (no I2F), the dequantized V tile stays in packed
    fp16 math, and fp16 keeps 3 more mantissa bits (q is post-norm/RoPE, far inside fp16 range)."""
    if bits < 16 and q_dtype != torch.float32:
        return tl.float16
    return TL_DTYPES[q_dtype]


def use_asm(device: torch.device) -> bool:
    """Inline PTX runs on NVIDIA GPUs only (not under TRITON_INTERPRET=1, which runs on the CPU)."""
    return device.type == "cuda" and torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def tile_rows(bt_row_ptr, tok, hi, kvh, stride_n, stride_h, stride_s, BS: tl.constexpr):
    """tok: [BLOCK_N] logical positions -> (valid [BLOCK_N], code row offsets int64, scale offsets).

    A token is valid when it is inside the context (tok < hi) and its block is not a hole (-1).
    Positions are never renumbered: a hole simply contributes no keys.
    """
    in_range = tok < hi
    phys = tl.load(bt_row_ptr + tok // BS, mask=in_range, other=-1)
    valid = in_range & (phys >= 0)
    phys64 = tl.where(valid, phys, 0).to(tl.int64)
    rows = phys64 * stride_n + kvh * stride_h + (tok % BS) * stride_s
    return valid, rows, phys64


@triton.jit
def _f16_magic(c):
    """Small integers (int8, or nibbles 0..15) -> fp16 exactly, without the quarter-rate I2F: for
    0 <= m < 1024 the fp16 bit pattern of 1024 + m is 0x6400 + m, so an integer add, a
    reinterpretation and one (packed) fp16 subtraction rebuild the value."""
    return (c.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def s8_to_f16(c, ASM: tl.constexpr):
    """int8 codes -> fp16, exact. ASM (GPU only; the interpreter cannot run PTX) also keeps the
    compiler from moving the int8 tile into the dot-operand layout before converting, which
    costs one byte-wide shared-memory load per element."""
    if ASM:
        # 4 bytes per call: bias to unsigned (x ^ 0x80), splice each byte under an 0x64 high byte
        # (fp16 1024 + u) with one byte permute per pair, subtract 1152 with one packed op per pair
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t, z, c;
            mov.b32 z, 0x64646464;
            mov.b32 c, 0x64806480;
            xor.b32 t, $2, 0x80808080;
            prmt.b32 $0, t, z, 0x4140;
            prmt.b32 $1, t, z, 0x4342;
            sub.f16x2 $0, $0, c;
            sub.f16x2 $1, $1, c;
            }""",
            "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return _f16_magic(c)


@triton.jit
def u4_to_f16(packed, ASM: tl.constexpr):
    """packed uint8 (dim d low nibble, d + D/2 high nibble) -> (fp16 low, fp16 high), exact."""
    if ASM:
        # 4 bytes per call: spread bytes into 16-bit lanes, mask a nibble, OR in 0x6400, subtract 1024
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 x, y, t, z, m, o, c;
            mov.b32 z, 0;
            mov.b32 m, 0x000F000F;
            mov.b32 o, 0x64006400;
            prmt.b32 x, $4, z, 0x4140;
            prmt.b32 y, $4, z, 0x4342;
            lop3.b32 $0, x, m, o, 0xEA;
            lop3.b32 $1, y, m, o, 0xEA;
            shr.b32 t, x, 4;
            lop3.b32 $2, t, m, o, 0xEA;
            shr.b32 t, y, 4;
            lop3.b32 $3, t, m, o, 0xEA;
            sub.f16x2 $0, $0, o;
            sub.f16x2 $1, $1, o;
            sub.f16x2 $2, $2, o;
            sub.f16x2 $3, $3, o;
            }""",
            "=r,=r,=r,=r,r", [packed], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        return _f16_magic(packed & 15), _f16_magic(packed >> 4)


@triton.jit
def int8_to(c, CDT: tl.constexpr, ASM: tl.constexpr):
    if CDT == tl.float16:
        return s8_to_f16(c, ASM)
    else:
        return c.to(CDT)


@triton.jit
def int4_to(packed, CDT: tl.constexpr, ASM: tl.constexpr):
    """-> (dims [0, D/2), dims [D/2, D)) in CDT."""
    if CDT == tl.float16:
        return u4_to_f16(packed, ASM)
    else:
        return (packed & 15).to(CDT), (packed >> 4).to(CDT)


@triton.jit
def qk_scores(q_lo, q_hi, q_sum, k_ptr, ks_ptr, kz_ptr, rows, srows, valid, offs_d, d_mask,
              DH: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Scores [BLOCK_M, BLOCK_N] fp32 = q @ K^T, K read from the paged cache (dequant folded in).

    q_lo, q_hi: [BLOCK_M, BLOCK_DH] query halves in the compute dtype; q_sum: [BLOCK_M] fp32.
    rows: [BLOCK_N] int64 element offsets of each token's code row; srows: offsets into scales.
    """
    CDT = q_lo.dtype
    m2 = valid[None, :] & d_mask[:, None]  # [BLOCK_DH, BLOCK_N]
    if BITS == 4:
        # one byte holds dim d (low nibble) and d + D/2 (high nibble)
        c_lo, c_hi = int4_to(tl.load(k_ptr + rows[None, :] + offs_d[:, None], mask=m2, other=0), CDT, ASM)
        s = tl.dot(q_hi, c_hi, tl.dot(q_lo, c_lo))
        ks = tl.load(ks_ptr + srows, mask=valid, other=0.0).to(tl.float32)
        kz = tl.load(kz_ptr + srows, mask=valid, other=0.0).to(tl.float32)
        s = s * ks[None, :] + q_sum[:, None] * kz[None, :]
    else:
        k_lo = tl.load(k_ptr + rows[None, :] + offs_d[:, None], mask=m2, other=0)
        k_hi = tl.load(k_ptr + rows[None, :] + DH + offs_d[:, None], mask=m2, other=0)
        if BITS == 8:
            k_lo = int8_to(k_lo, CDT, ASM)
            k_hi = int8_to(k_hi, CDT, ASM)
        s = tl.dot(q_hi, k_hi.to(CDT), tl.dot(q_lo, k_lo.to(CDT)))
        if BITS == 8:
            ks = tl.load(ks_ptr + srows, mask=valid, other=0.0).to(tl.float32)
            s = s * ks[None, :]
    return s


@triton.jit
def pv_accumulate(p, acc_lo, acc_hi, v_ptr, vs_ptr, vz_ptr, rows, srows, valid, offs_d, d_mask,
                  DH: tl.constexpr, BITS: tl.constexpr, CDT: tl.constexpr, ASM: tl.constexpr):
    """acc += p @ V for one tile. p: [BLOCK_M, BLOCK_N] fp32 (0 on invalid tokens); acc: fp32 halves.

    V codes are dequantized in registers in the compute dtype (fp16 for quantized caches: one
    packed multiply-add per element, never written back). Folding the V scales into p instead would
    push p*s below fp16's range for small weights.
    """
    m2 = valid[:, None] & d_mask[None, :]  # [BLOCK_N, BLOCK_DH]
    if BITS == 4:
        vs = tl.load(vs_ptr + srows, mask=valid, other=0.0).to(CDT)[:, None]
        vz = tl.load(vz_ptr + srows, mask=valid, other=0.0).to(CDT)[:, None]
        c_lo, c_hi = int4_to(tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0), CDT, ASM)
        v_lo = c_lo * vs + vz
        v_hi = c_hi * vs + vz
    elif BITS == 8:
        vs = tl.load(vs_ptr + srows, mask=valid, other=0.0).to(CDT)[:, None]
        v_lo = int8_to(tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0), CDT, ASM) * vs
        v_hi = int8_to(tl.load(v_ptr + rows[:, None] + DH + offs_d[None, :], mask=m2, other=0), CDT, ASM) * vs
    else:
        v_lo = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0.0)
        v_hi = tl.load(v_ptr + rows[:, None] + DH + offs_d[None, :], mask=m2, other=0.0)
    pc = p.to(CDT)
    acc_lo = tl.dot(pc, v_lo.to(CDT), acc_lo)
    acc_hi = tl.dot(pc, v_hi.to(CDT), acc_hi)
    return acc_lo, acc_hi


@triton.jit
def online_softmax_step(s, m_i, l_i, acc_lo, acc_hi):
    """One flash-attention update in base 2. s: [BLOCK_M, BLOCK_N] fp32 scores already scaled by
    softmax_scale * log2(e), -inf where masked. Rows whose keys are all masked so far keep m = -inf
    and contribute nothing (the `m_safe` guard avoids -inf - -inf = NaN)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc_lo = acc_lo * alpha[:, None]
    acc_hi = acc_hi * alpha[:, None]
    return p, m_new, l_i, acc_lo, acc_hi


def kv_meta_args(cache) -> tuple:
    """(k_scale, v_scale, k_zero, v_zero) with placeholders for the formats that lack them."""
    ph = cache.k  # any tensor: never dereferenced when BITS says the field is absent
    return (cache.k_scale if cache.k_scale is not None else ph,
            cache.v_scale if cache.v_scale is not None else ph,
            cache.k_zero if cache.k_zero is not None else ph,
            cache.v_zero if cache.v_zero is not None else ph)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))
