"""Paged int8 decode with the products transposed ("swap AB"): tokens on the MMA's M side.

The untransposed decode (triton_decode) pads the G query heads of a KV group to 16 MMA rows, so at
G = 2 most of each score tile and of the [16, D] fp32 accumulator is padding. Here both products
are written the other way round, as in TensorRT-LLM's and FlashInfer's small-group decode:

    s^T [BLOCK_N, G] = K [BLOCK_N, D] @ q^T [D, G]          (K codes are the A operand)
    o^T [D, G]      += V^T [D, BLOCK_N] @ (p * vs)^T [BLOCK_N, G]

G sits on the MMA's N side, which the compiler pads to 8, not 16: the accumulator is [D, 8] and a
tile needs half the MMA instructions. Same cache format, same folds (K scales on the score rows,
V scales into the softmax weights) and split-K contract as triton_decode; int8 word reads only.

Offset codes (OFFSET, TritonConfig.quant_offset_codes): the tiles enter both products as fp16
1152 + code, the bit pattern the word expansion makes before its subtraction (triton_dequant), so
that subtraction (one packed op per two codes) is not done per element but once per product:
    q . (1152 + c) = q . c + 1152 * sum_d q_d                       (sum_d q_d once per program)
    sum_n w_n (1152 + c_n) = sum_n w_n c_n + 1152 * sum_n w_n       (w = p * vs; sum kept like l)
Products of fp16 values are exact in the MMA and accumulate in fp32: the offset costs about 4 of
fp32's 24 bits (1152 against |code| <= 127), far below the int8 step (tests: same tolerance).
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanokv.kernels.triton_dequant import load_code_words
from nanokv.kernels.triton_kvtile import split_range, tile_rows
from nanokv.kernels.triton_softmax import store_decode


# metadata pointers and sizes vary step to step: not specialized on (see triton_decode)
@triton.jit(do_not_specialize=["bt_ptr", "seq_lens_ptr", "num_splits", "stride_bt"])
def decode_int8_swap_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, kst_ptr, vst_ptr, stage_ptr, bt_ptr, seq_lens_ptr,
    out_ptr, part_o_ptr, part_ml_ptr,
    qk_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kn, stride_kh, stride_ks, stride_sn, stride_sh, stride_bt,
    stride_cn, stride_ch, stride_stn, stride_sth,
    D: tl.constexpr, DH: tl.constexpr, G: tl.constexpr, BS: tl.constexpr,
    CDT: tl.constexpr, ASM: tl.constexpr, WORDS: tl.constexpr, FOLD_V: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    LAZY_TAU: tl.constexpr, OFFSET: tl.constexpr,
):
    # argument list of triton_decode._decode_kernel (one launch site); zero points and staging are
    # unused by int8. k_ptr / v_ptr: int32 views of the codes (WORDS)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    _, lo, hi = split_range(seq_lens_ptr, seq, split, num_splits, BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_DH)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    heads = kvh * G + offs_g
    qt_rows = q_ptr + seq * stride_qt + heads[None, :] * stride_qh + offs_d[:, None]
    qm = g_mask[None, :] & (offs_d < DH)[:, None]
    qt_lo = tl.load(qt_rows, mask=qm, other=0.0).to(CDT)  # [BLOCK_DH, BLOCK_G]: q^T halves
    qt_hi = tl.load(qt_rows + DH, mask=qm, other=0.0).to(CDT)
    q_off = tl.zeros([BLOCK_G], tl.float32)  # OFFSET: 1152 * sum_d q_d, taken out of every score
    if OFFSET:
        q_off = 1152.0 * (tl.sum(qt_lo.to(tl.float32), axis=0) + tl.sum(qt_hi.to(tl.float32), axis=0))

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    w_i = tl.zeros([BLOCK_G], tl.float32)  # sum_n (p * vs)_n as the PV product saw it (fp16-rounded)
    acc_lo = tl.zeros([BLOCK_DH, BLOCK_G], tl.float32)  # o^T halves, offset codes
    acc_hi = tl.zeros([BLOCK_DH, BLOCK_G], tl.float32)
    bt_row = bt_ptr + seq * stride_bt
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n
        if BS % BLOCK_N == 0:  # the tile lies in one block: one table read, rows known contiguous
            phys_s = tl.load(bt_row + start // BS)
            # (phys_s + 0 * offs_n): broadcast before comparing; the CPU interpreter types a bool
            # tensor & bool scalar as int32, which it then refuses as a load mask
            valid = (tok < hi) & (phys_s + 0 * offs_n >= 0)
            phys = tl.maximum(phys_s, 0).to(tl.int64)
            rows = phys * stride_kn + kvh * stride_kh + (tok % BS) * stride_ks
        else:
            valid, rows, phys = tile_rows(bt_row, tok, hi, kvh, stride_kn, stride_kh, stride_ks, BS)
        srows = phys * stride_sn + kvh * stride_sh + tok % BS
        k_lo = load_code_words(k_ptr, rows, valid, 0, BLOCK_N, BLOCK_DH, 8, ASM, OFFSET)  # [BLOCK_N, BLOCK_DH]
        k_hi = load_code_words(k_ptr, rows, valid, 1, BLOCK_N, BLOCK_DH, 8, ASM, OFFSET)
        st = tl.dot(k_hi, qt_hi, tl.dot(k_lo, qt_lo)) - q_off[None, :]  # [BLOCK_N, BLOCK_G] q . codes
        ks = tl.load(ks_ptr + srows, mask=valid, other=0.0).to(tl.float32)
        st = tl.where(valid[:, None], st * (ks * qk_scale)[:, None], float("-inf"))
        m_new = tl.maximum(m_i, tl.max(st, axis=0))
        if LAZY_TAU > 0:  # keep the reference max until some head's grows by more than LAZY_TAU
            grow = tl.max(m_new - m_i, axis=0) > LAZY_TAU  # a first key: +inf; none yet: NaN, False
            m_new = tl.where(grow, m_new, m_i)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)  # 1 exactly while the reference max holds
        pt = tl.exp2(st - m_safe[None, :])  # [BLOCK_N, BLOCK_G], <= 2^LAZY_TAU
        l_i = l_i * alpha + tl.sum(pt, axis=0)
        m_i = m_new
        vs = tl.load(vs_ptr + srows, mask=valid, other=0.0)
        pv = (pt * vs.to(tl.float32)[:, None]).to(CDT)  # (p * vs)^T, range as in fold_v_weights
        if OFFSET:
            w_i = w_i * alpha + tl.sum(pv.to(tl.float32), axis=0)
        if LAZY_TAU > 0:
            if grow:
                acc_lo = acc_lo * alpha[None, :]
                acc_hi = acc_hi * alpha[None, :]
        else:
            acc_lo = acc_lo * alpha[None, :]
            acc_hi = acc_hi * alpha[None, :]
        v_lo = load_code_words(v_ptr, rows, valid, 0, BLOCK_N, BLOCK_DH, 8, ASM, OFFSET)
        v_hi = load_code_words(v_ptr, rows, valid, 1, BLOCK_N, BLOCK_DH, 8, ASM, OFFSET)
        acc_lo = tl.dot(tl.trans(v_lo), pv, acc_lo)
        acc_hi = tl.dot(tl.trans(v_hi), pv, acc_hi)

    if OFFSET:
        acc_lo = acc_lo - 1152.0 * w_i[None, :]
        acc_hi = acc_hi - 1152.0 * w_i[None, :]
    store_decode(tl.trans(acc_lo), tl.trans(acc_hi), m_i, l_i, offs_g, kvh, seq, split, num_splits, out_ptr,
                 part_o_ptr, part_ml_ptr, stride_ot, stride_oh, D, DH, G, BLOCK_DH, SPLIT)
