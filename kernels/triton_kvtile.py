"""Shared Triton helpers: read one tile of paged K/V and fold the dequantization into the math.

Both attention kernels (decode and prefill) walk a sequence's context in tiles of BLOCK_N tokens.
A tile may span several cache blocks (small block sizes) or part of one (large ones): each token
finds its physical block through the block table, so any power-of-2 block size works.

Head dims are handled as two halves [0, D/2) and [D/2, D): that is what the int4 format packs
into the low and high nibbles, and using it for every format keeps one code path. Quantized
codes are never expanded to a full-precision copy of the cache: tiles are dequantized in
registers (triton_dequant); int8 K scales multiply the score columns after the dot, int8 V scales
may fold into the softmax weights (decode). int4 keys have a scale and zero per (block, channel):
here their tiles are dequantized in registers before the dot (prefill, and decode with fold_k off;
triton_decode_int4 folds them into the query), and tokens of open blocks (int4 staging,
nanokv.kv.staging) are read in full precision instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton_dequant import load_code_words
from nanokv.kernels.triton_vcodes import int4_value_codes, int8_value_codes
from nanokv.kv.cache import FullKV, Int4KV, LayerKV

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def compute_dtype(q_dtype: torch.dtype, bits: int) -> tl.dtype:
    """Operand dtype of the two products. Quantized caches use fp16 even for bf16 models: codes
    convert to fp16 exactly and cheaply, the dequantized V tile stays in packed fp16 math, and fp16
    keeps 3 more mantissa bits (q is post-norm/RoPE, far inside fp16 range)."""
    if bits < 16 and q_dtype != torch.float32:
        return tl.float16
    return TL_DTYPES[q_dtype]


@triton.jit
def tile_rows(bt_row_ptr, tok, hi, kvh, stride_n, stride_h, stride_s, BS: tl.constexpr):
    """tok: [BLOCK_N] logical positions -> (valid [BLOCK_N], code row offsets int64, physical block).

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
def split_range(seq_lens_ptr, seq, split, num_splits, BLOCK_N: tl.constexpr):
    """Decode: (seq_len, lo, hi), this program's token range [lo, hi) of its sequence in whole tiles,
    derived on the device from seq_len (so a captured graph stays valid for any lengths)."""
    seq_len = tl.load(seq_lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)
    return seq_len, lo, hi


@triton.jit
def qk_scores(q_lo, q_hi, k_ptr, ks_ptr, kz_ptr, rows, srows, valid, offs_d, d_mask,
              kst_ptr, crows, strows, staged,
              DH: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, WORDS: tl.constexpr,
              STAGING: tl.constexpr):
    """Scores [BLOCK_M, BLOCK_N] fp32 = q @ K^T, K read from the paged cache (dequant folded in).

    q_lo, q_hi: [BLOCK_M, BLOCK_DH] query halves in the compute dtype.
    rows: [BLOCK_N] element offsets of each token's code row; srows: offsets into the scales.
    WORDS: quantized key codes read as int32 words (k_ptr is an int32 view), fp16 tiles.
    int4 only (see stage_rows): crows [BLOCK_N] offsets of each token's per-channel scale/zero row,
    strows offsets into the full-precision staging kst_ptr, staged [BLOCK_N] reads from staging.
    STAGING (int4): 2 any mix of staged and quantized tokens, 1 every valid token staged (read as a
    16-bit tile, no codes), 0 none staged (no staging loads; triton_prefill's runs of tiles).
    """
    CDT = q_lo.dtype
    if BITS == 4 and STAGING == 1:
        s = _qk_rows(q_lo, q_hi, kst_ptr, strows, staged, offs_d, d_mask, DH)
    elif BITS < 16:
        if WORDS:
            if BITS == 4:
                c_lo, c_hi = load_code_words(k_ptr, rows, valid, 0, rows.shape[0], q_lo.shape[1], 4, ASM)
            else:
                c_lo = load_code_words(k_ptr, rows, valid, 0, rows.shape[0], q_lo.shape[1], 8, ASM)
                c_hi = load_code_words(k_ptr, rows, valid, 1, rows.shape[0], q_lo.shape[1], 8, ASM)
        else:  # generic path (fp32 compute, odd head dims): [BLOCK_N, BLOCK_DH] code tiles
            m2 = valid[:, None] & d_mask[None, :]
            if BITS == 4:  # one byte holds dim d (low nibble) and d + D/2 (high nibble)
                packed = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0)
                c_lo, c_hi = (packed & 15).to(CDT), (packed >> 4).to(CDT)
            else:
                c_lo = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0).to(CDT)
                c_hi = tl.load(k_ptr + rows[:, None] + DH + offs_d[None, :], mask=m2, other=0).to(CDT)
        if BITS == 4:  # per-channel scales differ per block: dequantize the tile in registers
            k_lo = _chan_dequant(c_lo, ks_ptr, kz_ptr, crows, valid, offs_d, d_mask, kst_ptr, strows, staged, CDT,
                                 STAGING)
            k_hi = _chan_dequant(c_hi, ks_ptr + DH, kz_ptr + DH, crows, valid, offs_d, d_mask, kst_ptr + DH,
                                 strows, staged, CDT, STAGING)
            s = tl.dot(q_hi, tl.trans(k_hi), tl.dot(q_lo, tl.trans(k_lo)))
        else:
            s = tl.dot(q_hi, tl.trans(c_hi), tl.dot(q_lo, tl.trans(c_lo)))
            s = s * tl.load(ks_ptr + srows, mask=valid, other=0.0).to(tl.float32)[None, :]
    else:
        s = _qk_rows(q_lo, q_hi, k_ptr, rows, valid, offs_d, d_mask, DH)
    return s


@triton.jit
def _qk_rows(q_lo, q_hi, k_ptr, rows, valid, offs_d, d_mask, DH: tl.constexpr):
    """Scores from 16-bit key rows (the cache's, or int4 staging's): rows [BLOCK_N] element offsets."""
    m2 = valid[None, :] & d_mask[:, None]  # [BLOCK_DH, BLOCK_N]: K^T tile, d contiguous
    k_lo = tl.load(k_ptr + rows[None, :] + offs_d[:, None], mask=m2, other=0.0)
    k_hi = tl.load(k_ptr + rows[None, :] + DH + offs_d[:, None], mask=m2, other=0.0)
    return tl.dot(q_hi, k_hi.to(q_lo.dtype), tl.dot(q_lo, k_lo.to(q_lo.dtype)))


@triton.jit
def _chan_dequant(c, s_ptr, z_ptr, crows, valid, offs_d, d_mask, st_ptr, strows, staged, CDT: tl.constexpr,
                  STAGING: tl.constexpr):
    """int4 key half-tile: codes c [BLOCK_N, BLOCK_DH] -> c * scale[channel] + zero[channel] (fp32
    math: a channel's zero point can be far larger than its step), staged tokens from staging
    (none staged when STAGING == 0)."""
    m2 = valid[:, None] & d_mask[None, :]
    sc = tl.load(s_ptr + crows[:, None] + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
    zr = tl.load(z_ptr + crows[:, None] + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
    x = c.to(tl.float32) * sc + zr
    if STAGING != 0:
        fm = staged[:, None] & d_mask[None, :]
        f = tl.load(st_ptr + strows[:, None] + offs_d[None, :], mask=fm, other=0.0).to(tl.float32)
        x = tl.where(staged[:, None], f, x)
    return x.to(CDT)


@triton.jit
def stage_rows(stage_ptr, phys, valid, tok, kvh, stride_cn, stride_ch, stride_stn, stride_sth,
               BS: tl.constexpr, D: tl.constexpr, LOOKUP: tl.constexpr = True):
    """int4: (crows, strows, staged) for a tile of tokens, see qk_scores. A block whose staging
    slot (stage_ptr: [N] int32, -1 = none) is set is still open: it is read from staging [S, H, bs, D].
    LOOKUP False: a tile known to hold codes only (staged all False, strows unused)."""
    crows = phys * stride_cn + kvh * stride_ch
    if not LOOKUP:
        return crows, crows, valid & False
    st = tl.load(stage_ptr + phys, mask=valid, other=-1)
    staged = valid & (st >= 0)
    strows = tl.where(staged, st, 0).to(tl.int64) * stride_stn + kvh * stride_sth + (tok % BS) * D
    return crows, strows, staged


@triton.jit
def pv_accumulate(p, acc_lo, acc_hi, v_ptr, vs_ptr, vz_ptr, rows, srows, valid, offs_d, d_mask,
                  vst_ptr, strows, staged,
                  bt_row_ptr, start, hi, kvh, stride_n, stride_h,
                  DH: tl.constexpr, BITS: tl.constexpr, CDT: tl.constexpr, ASM: tl.constexpr,
                  WORDS: tl.constexpr, FOLD_V: tl.constexpr, BS: tl.constexpr, STAGING: tl.constexpr):
    """acc += p @ V for one tile of tokens [start, start + BLOCK_N). p: [BLOCK_M, BLOCK_N] fp32 (0
    on invalid tokens); acc: fp32 halves. int8 and int4 values are read through the block table by
    int8_value_codes / int4_value_codes (bt_row_ptr .. stride_h; dims-major blocks), never as words;
    16-bit values use rows.

    int8 with FOLD_V: the per-token V scale goes into p instead of into every V element,
    acc += (p * vs[None, :]) @ codes: [BLOCK_M, BLOCK_N] multiplies instead of [BLOCK_N, D]; see
    fold_v_weights for why fp16 holds p * vs. Otherwise (and always for int4 here, whose staged
    tokens mix with quantized ones in a tile) V is dequantized in registers in the compute dtype
    (one packed multiply-add per element). STAGING (int4) as in qk_scores.
    """
    m2 = valid[:, None] & d_mask[None, :]  # [BLOCK_N, BLOCK_DH]
    pc = p.to(CDT)
    if BITS == 4 and STAGING == 1:  # every valid token staged: a 16-bit tile, no codes (qk_scores)
        fm = staged[:, None] & d_mask[None, :]
        v_lo = tl.load(vst_ptr + strows[:, None] + offs_d[None, :], mask=fm, other=0.0)
        v_hi = tl.load(vst_ptr + strows[:, None] + DH + offs_d[None, :], mask=fm, other=0.0)
    elif BITS < 16:
        BLOCK_N: tl.constexpr = p.shape[1]
        if BITS == 4:
            c_lo, c_hi = int4_value_codes(v_ptr, bt_row_ptr, start, hi, kvh, stride_n, stride_h, offs_d, d_mask,
                                          BS, BLOCK_N, CDT, ASM)
        else:
            c_lo = int8_value_codes(v_ptr, bt_row_ptr, start, hi, kvh, stride_n, stride_h, offs_d, d_mask, 0,
                                    DH, BS, BLOCK_N, CDT, ASM)
            c_hi = int8_value_codes(v_ptr, bt_row_ptr, start, hi, kvh, stride_n, stride_h, offs_d, d_mask, 1,
                                    DH, BS, BLOCK_N, CDT, ASM)
        if BITS == 4:
            vs = tl.load(vs_ptr + srows, mask=valid, other=0.0).to(CDT)[:, None]
            vz = tl.load(vz_ptr + srows, mask=valid, other=0.0).to(CDT)[:, None]
            v_lo = c_lo * vs + vz
            v_hi = c_hi * vs + vz
            if STAGING != 0:
                fm = staged[:, None] & d_mask[None, :]  # open blocks: full precision from staging
                f_lo = tl.load(vst_ptr + strows[:, None] + offs_d[None, :], mask=fm, other=0.0).to(CDT)
                f_hi = tl.load(vst_ptr + strows[:, None] + DH + offs_d[None, :], mask=fm, other=0.0).to(CDT)
                v_lo = tl.where(staged[:, None], f_lo, v_lo)
                v_hi = tl.where(staged[:, None], f_hi, v_hi)
        elif FOLD_V:
            pc = fold_v_weights(p, tl.load(vs_ptr + srows, mask=valid, other=0.0), CDT)
            v_lo, v_hi = c_lo, c_hi
        else:
            vs = tl.load(vs_ptr + srows, mask=valid, other=0.0).to(CDT)[:, None]
            v_lo = c_lo * vs
            v_hi = c_hi * vs
    else:
        v_lo = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0.0)
        v_hi = tl.load(v_ptr + rows[:, None] + DH + offs_d[None, :], mask=m2, other=0.0)
    acc_lo = tl.dot(pc, v_lo.to(CDT), acc_lo)
    acc_hi = tl.dot(pc, v_hi.to(CDT), acc_hi)
    return acc_lo, acc_hi


@triton.jit
def fold_v_weights(p, vs, CDT: tl.constexpr):
    """p [BLOCK_M, BLOCK_N] fp32 softmax weights, vs [BLOCK_N] fp16 per-token V scales -> p * vs in
    the compute dtype, the PV operand that multiplies raw codes.

    The product is formed in fp32 and rounded once. Range: 0 <= p <= 1 (exp2 of s - rowmax) and vs
    is an fp16 value, so p * vs <= 65504 never overflows (with lazy rescaling p <= 2^tau: overflow
    would need vs > 65504 / 2^tau, i.e. |V| above 32k for int8 at tau 8). Below 2^-14 it is subnormal: absolute
    error <= 2^-25 per code unit, i.e. <= 3.8e-6 per token for int8 (|code| <= 127) and 4.5e-7 for
    int4 (<= 15), in output units before the division by l >= 1. That is 1e-3 of the quantization
    step itself (vs / 2 per element), and measured against the unfolded path in
    tests/kernels/test_kernels_attention.py (peaked softmax included).
    """
    return (p * vs.to(tl.float32)[None, :]).to(CDT)


def stage_args(cache: LayerKV) -> tuple:
    """(k_stage, v_stage, stage map, k-scale strides n/h, staging strides n/h); placeholders and 0
    for the formats without staging (never dereferenced there)."""
    if not isinstance(cache, Int4KV):
        return cache.k, cache.k, cache.k, 0, 0, 0, 0
    return (cache.k_stage, cache.v_stage, cache.stage.stage_of, cache.k_scale.stride(0),
            cache.k_scale.stride(1), cache.k_stage.stride(0), cache.k_stage.stride(1))


def code_args(cache: LayerKV, words: bool, byte_keys: bool = False) -> tuple:
    """(k, v) code tensors as the kernels take them: keys as an int32 view where codes are read as
    words, as stored otherwise or when the kernel reads byte tiles (`byte_keys`: the transposed int8
    kernel, both int4 kernels). Values are never words (quantized ones are stored dims-major,
    nanokv.kv.cache)."""
    return (cache.k.view(torch.int32) if words and not byte_keys else cache.k), cache.v


def kv_meta_args(cache: LayerKV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_scale, v_scale, k_zero, v_zero) with placeholders for the formats that lack them."""
    ph = cache.k  # any tensor: never dereferenced when BITS says the field is absent
    if isinstance(cache, FullKV):
        return ph, ph, ph, ph
    if isinstance(cache, Int4KV):
        return cache.k_scale, cache.v_scale, cache.k_zero, cache.v_zero
    return cache.k_scale, cache.v_scale, ph, ph


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))
