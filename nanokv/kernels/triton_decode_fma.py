"""Paged decode for quantized caches on the CUDA cores (FMA), no tensor cores.

With G = Hq / Hkv query heads per KV head (2 for Qwen3-0.6B) a decode step is a pair of
matrix-vector products per KV head. The tensor-core kernels (triton_decode, triton_decode_int4)
pad G to a 16-row MMA tile, and the padded accumulators and operand tiles cost so many registers
that too few warps are left to hide memory latency (docs/kernels.md, session 5). Here every code
is expanded to fp32 once and used by G fused multiply-adds; nothing is padded but G to a power of 2.

Layout. A tile of BLOCK_N = NP * T tokens is read as int32 words [NP, T, DWH]: one half of the head
dim per word row (int8: two reads, dims [0, D/2) and [D/2, D); int4: one read, the low nibbles are
the first half and the high nibbles the second, nanokv.kv.cache). Each thread holds 16-byte runs of
a row, T rows side by side in a warp, and the NP rows it owns one above the other, so
  - scores reduce over DWH (in-thread adds, then a few shuffles), and
  - the PV product reduces over NP in-thread only: the accumulators [BG, T, DWH] keep T partial
    rows per thread and are summed over T once, at the end.
A word's code j (byte j, or its nibble) is dim 4 * word + j of its half, so the query and the
accumulators are kept as 4 "lanes" per half, [BG, DWH] each: q_j[g, w] = q[g, 4w + j].

Code to float: for 0 <= u < 2^23 the fp32 with bits 0x4B000000 | u is 2^23 + u, so one integer OR
and one float subtraction give a code exactly (no int-to-float instruction, a quarter-rate op).
Scales fold into the products: int8 keys' per-token scale multiplies the score, the per-token V
scale the softmax weight; int4's per-channel key scale multiplies the query (once per tile) and its
zero point adds q . z per tile; the V zero point adds sum_n p_n vz_n to every dim.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanokv.kernels.triton_kvtile import split_range, tile_rows
from nanokv.kernels.triton_softmax import store_decode


@triton.jit
def _byte_lanes(w):
    """int8: the 4 bytes of each int32 word -> fp32 [256 b0, b1, 256 b2, b3]... exactly, 9 instructions.

    (w & 0xFF) ^ 0x4B000080 (one LOP3) has 2^23's bits above and b ^ 0x80 = b + 128 below, so it
    reads as the fp32 2^23 + 128 + b; byte 1 in place ((w & 0xFF00) ^ 0x4B008000) reads as
    2^23 + 256 (128 + b), which stays below 2^24 and exact. Bytes 2 and 3 do the same after one
    shift. So lanes 1 and 3 come out scaled by 256 (an exact power of 2, undone by the caller),
    which saves the byte-extracting shifts. Returns (lane 0, lane 1 * 256, lane 2, lane 3 * 256).
    """
    t = w >> 16
    c0 = (w & 0xFF) ^ 0x4B000080
    c1 = (w & 0xFF00) ^ 0x4B008000
    c2 = (t & 0xFF) ^ 0x4B000080
    c3 = (t & 0xFF00) ^ 0x4B008000
    return (c0.to(tl.float32, bitcast=True) - 8388736.0, c1.to(tl.float32, bitcast=True) - 8421376.0,
            c2.to(tl.float32, bitcast=True) - 8388736.0, c3.to(tl.float32, bitcast=True) - 8421376.0)


@triton.jit
def _load_words(c_ptr, rows, valid, HALF: tl.constexpr, DWH: tl.constexpr):
    """[1, NP, T, DWH] int32 words of each token's code row half. rows: [1, NP, T, 1] byte offsets."""
    offs_w = tl.arange(0, DWH)[None, None, None, :]
    return tl.load(c_ptr + rows // 4 + HALF * DWH + offs_w, mask=valid, other=0)


@triton.jit
def _q_lanes(q_ptr, rows_g, g_mask, HALF_OFF: tl.constexpr, DWH: tl.constexpr):
    """q_j[g, 0, 0, w] = q[g, HALF_OFF + 4w + j] (fp32) for j = 0..3, lanes 1 and 3 divided by 256 to
    meet _byte_lanes' scaled codes. rows_g, g_mask: [BG, 1, 1, 1]."""
    base = q_ptr + rows_g + HALF_OFF + 4 * tl.arange(0, DWH)[None, None, None, :]
    q0 = tl.load(base, mask=g_mask, other=0.0).to(tl.float32)
    q1 = tl.load(base + 1, mask=g_mask, other=0.0).to(tl.float32) * 0.00390625
    q2 = tl.load(base + 2, mask=g_mask, other=0.0).to(tl.float32)
    q3 = tl.load(base + 3, mask=g_mask, other=0.0).to(tl.float32) * 0.00390625
    return q0, q1, q2, q3


@triton.jit
def _qdot(q0, q1, q2, q3, c0, c1, c2, c3):
    """sum_j q_j * c_j: [BG, NP, T, DWH] partial products of one half (reduced by the caller)."""
    return q0 * c0 + q1 * c1 + q2 * c2 + q3 * c3


@triton.jit
def _pv(pv, a0, a1, a2, a3, c0, c1, c2, c3):
    """acc_j += sum over NP of pv * c_j. pv: [BG, NP, T, 1]; acc_j: [BG, 1, T, DWH]."""
    return (a0 + tl.sum(pv * c0, axis=1, keep_dims=True), a1 + tl.sum(pv * c1, axis=1, keep_dims=True),
            a2 + tl.sum(pv * c2, axis=1, keep_dims=True), a3 + tl.sum(pv * c3, axis=1, keep_dims=True))


@triton.jit
def _out_half(a0, a1, a2, a3, BG: tl.constexpr, DH: tl.constexpr):
    """4 lane accumulators [BG, 1, T, DH / 4] -> [BG, DH], dim 4w + j from lane j, summed over T
    (lanes 1 and 3 hold 256 x their values, see _byte_lanes)."""
    o0 = tl.reshape(tl.sum(a0, axis=2), [BG, DH // 4])
    o1 = tl.reshape(tl.sum(a1, axis=2), [BG, DH // 4]) * 0.00390625
    o2 = tl.reshape(tl.sum(a2, axis=2), [BG, DH // 4])
    o3 = tl.reshape(tl.sum(a3, axis=2), [BG, DH // 4]) * 0.00390625
    return tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), [BG, DH])


@triton.jit(do_not_specialize=["bt_ptr", "seq_lens_ptr", "num_splits", "stride_bt"])
def decode_fma_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, kst_ptr, vst_ptr, stage_ptr, bt_ptr, seq_lens_ptr,
    out_ptr, part_o_ptr, part_ml_ptr,
    qk_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kn, stride_kh, stride_ks, stride_sn, stride_sh, stride_bt,
    stride_cn, stride_ch, stride_stn, stride_sth,
    D: tl.constexpr, DH: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr,
    BG: tl.constexpr, NP: tl.constexpr, T: tl.constexpr, SPLIT: tl.constexpr, LAZY_TAU: tl.constexpr,
):
    """Grid (num_decodes, num_kv_heads, num_splits); arguments as triton_decode._decode_kernel.
    Every tensor of the loop is 4-D [BG, NP, T, DWH] or a broadcast of it (size-1 dims), so the
    compiler keeps one register layout throughout (no shared-memory layout changes per tile).
    int8 only so far (int4: see module docstring)."""
    BLOCK_N: tl.constexpr = NP * T
    DWH: tl.constexpr = DH // 4
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    _, lo, hi = split_range(seq_lens_ptr, seq, split, num_splits, BLOCK_N)

    offs_g = tl.arange(0, BG)[:, None, None, None]
    g_mask = offs_g < G
    rows_g = seq * stride_qt + (kvh * G + offs_g) * stride_qh
    qa0, qa1, qa2, qa3 = _q_lanes(q_ptr, rows_g, g_mask, 0, DWH)
    qb0, qb1, qb2, qb3 = _q_lanes(q_ptr, rows_g, g_mask, DH, DWH)
    nt = tl.arange(0, NP)[None, :, None, None] * T + tl.arange(0, T)[None, None, :, None]  # [1, NP, T, 1]

    m_i = tl.full([BG, 1, 1, 1], float("-inf"), tl.float32)
    l_i = tl.zeros([BG, 1, 1, 1], tl.float32)
    aa0 = tl.zeros([BG, 1, T, DWH], tl.float32)
    aa1, aa2, aa3 = aa0, aa0, aa0
    ab0, ab1, ab2, ab3 = aa0, aa0, aa0, aa0
    bt_row = bt_ptr + seq * stride_bt
    for start in range(lo, hi, BLOCK_N):
        tok = start + nt
        valid, rows, phys = tile_rows(bt_row, tok, hi, kvh, stride_kn, stride_kh, stride_ks, BS)
        srows = phys * stride_sn + kvh * stride_sh + tok % BS
        c0, c1, c2, c3 = _byte_lanes(_load_words(k_ptr, rows, valid, 0, DWH))
        s = _qdot(qa0, qa1, qa2, qa3, c0, c1, c2, c3)
        c0, c1, c2, c3 = _byte_lanes(_load_words(k_ptr, rows, valid, 1, DWH))
        s = tl.sum(s + _qdot(qb0, qb1, qb2, qb3, c0, c1, c2, c3), axis=3, keep_dims=True)  # [BG, NP, T, 1]
        ks = tl.load(ks_ptr + srows, mask=valid, other=0.0).to(tl.float32)
        s = tl.where(valid, s * (ks * qk_scale), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(tl.max(s, axis=2, keep_dims=True), axis=1, keep_dims=True))
        if LAZY_TAU > 0:  # keep the reference max (p <= 2^TAU) until some row's grows by more than TAU
            grow = tl.max(tl.reshape(m_new - m_i, [BG]), axis=0) > LAZY_TAU  # first key: +inf; none: NaN
            m_new = tl.where(grow, m_new, m_i)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe)
        l_i = l_i * alpha + tl.sum(tl.sum(p, axis=2, keep_dims=True), axis=1, keep_dims=True)
        m_i = m_new
        if LAZY_TAU > 0:
            if grow:
                aa0, aa1, aa2, aa3 = aa0 * alpha, aa1 * alpha, aa2 * alpha, aa3 * alpha
                ab0, ab1, ab2, ab3 = ab0 * alpha, ab1 * alpha, ab2 * alpha, ab3 * alpha
        else:
            aa0, aa1, aa2, aa3 = aa0 * alpha, aa1 * alpha, aa2 * alpha, aa3 * alpha
            ab0, ab1, ab2, ab3 = ab0 * alpha, ab1 * alpha, ab2 * alpha, ab3 * alpha
        pv = p * tl.load(vs_ptr + srows, mask=valid, other=0.0).to(tl.float32)
        c0, c1, c2, c3 = _byte_lanes(_load_words(v_ptr, rows, valid, 0, DWH))
        aa0, aa1, aa2, aa3 = _pv(pv, aa0, aa1, aa2, aa3, c0, c1, c2, c3)
        c0, c1, c2, c3 = _byte_lanes(_load_words(v_ptr, rows, valid, 1, DWH))
        ab0, ab1, ab2, ab3 = _pv(pv, ab0, ab1, ab2, ab3, c0, c1, c2, c3)

    store_decode(_out_half(aa0, aa1, aa2, aa3, BG, DH), _out_half(ab0, ab1, ab2, ab3, BG, DH),
                 tl.reshape(m_i, [BG]), tl.reshape(l_i, [BG]), tl.arange(0, BG), kvh, seq, split, num_splits,
                 out_ptr, part_o_ptr, part_ml_ptr, stride_ot, stride_oh, D, DH, G, DH, SPLIT)
