"""Paged int4 decode with the products transposed (tokens on the MMA's M side), one block per tile.

The int4 format and its folds are those of triton_decode_int4: a block's per-channel key scale s
and zero z fold into the query, q . k_n = (q * s) . c_n + q . z, and the per-token V scale and zero
into the softmax weights. Written as in triton_decode_swap,

    s^T [BLOCK_N, G] = codes [BLOCK_N, D] @ (q * s)^T [D, G] + (q . z)[None, :]
    o^T [D, G]      += codes_V^T [D, BLOCK_N] @ (p * vs)^T [BLOCK_N, G],   z_i += sum_n p_n vz_n

with BLOCK_N dividing the block size, so every tile lies in one block and needs one scaled query,
instead of the untransposed kernel's row groups (one padded row group per block of a tile).

Open blocks (staging) as in triton_decode_int4: the main loop reads codes only and masks staged
blocks; a second loop reads staged tokens in full precision over [newest block start, hi), or over
the whole split when the main loop met a staged block before the newest one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanokv.kernels.triton_decode_int4 import _codes4
from nanokv.kernels.triton_kvtile import split_range, stage_rows, tile_rows
from nanokv.kernels.triton_softmax import store_decode


@triton.jit
def _online_update(st, m_i, l_i):
    """Online softmax over axis 0 of transposed scores st [N, BLOCK_G] (base 2, -inf masked):
    (p^T, alpha, m_new, l_new)."""
    m_new = tl.maximum(m_i, tl.max(st, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    pt = tl.exp2(st - m_safe[None, :])
    return pt, alpha, m_new, l_i * alpha + tl.sum(pt, axis=0)


# metadata pointers and sizes vary step to step: not specialized on (see triton_decode)
@triton.jit(do_not_specialize=["bt_ptr", "seq_lens_ptr", "num_splits", "stride_bt"])
def decode_int4_swap_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, kst_ptr, vst_ptr, stage_ptr, bt_ptr, seq_lens_ptr,
    out_ptr, part_o_ptr, part_ml_ptr,
    qk_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kn, stride_kh, stride_ks, stride_sn, stride_sh, stride_bt,
    stride_cn, stride_ch, stride_stn, stride_sth,
    D: tl.constexpr, DH: tl.constexpr, G: tl.constexpr, BS: tl.constexpr,
    CDT: tl.constexpr, ASM: tl.constexpr, WORDS: tl.constexpr, FOLD_V: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr,
    SPLIT: tl.constexpr, LAZY_TAU: tl.constexpr,
):
    # argument list of decode_int4_kernel (FOLD_V and LAZY_TAU unused: V is always folded)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, lo, hi = split_range(seq_lens_ptr, seq, split, num_splits, BLOCK_N)
    newest = (tl.maximum(seq_len - 1, 0) // BS) * BS  # first position of the newest (open) block

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_DH)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < DH
    qm = (offs_g < G)[None, :] & d_mask[:, None]
    qt_rows = q_ptr + seq * stride_qt + (kvh * G + offs_g)[None, :] * stride_qh + offs_d[:, None]
    qt_lo = tl.load(qt_rows, mask=qm, other=0.0).to(tl.float32)  # [BLOCK_DH, BLOCK_G]: q^T halves
    qt_hi = tl.load(qt_rows + DH, mask=qm, other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    z_i = tl.zeros([BLOCK_G], tl.float32)  # sum_n p_n vz_n, added to every output dim at the end
    acc_lo = tl.zeros([BLOCK_DH, BLOCK_G], tl.float32)  # o^T halves
    acc_hi = tl.zeros([BLOCK_DH, BLOCK_G], tl.float32)
    bt_row = bt_ptr + seq * stride_bt
    early = tl.zeros([BLOCK_G], tl.int32)  # a staged block seen before the newest one
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n
        phys = tl.load(bt_row + start // BS)  # the tile's block (-1: a hole)
        st = tl.load(stage_ptr + tl.maximum(phys, 0))
        staged = (phys >= 0) & (st >= 0)
        early = early | (staged & (start < newest)).to(tl.int32)
        # [BLOCK_N] quantized tokens only; the scalars are broadcast before comparing because the CPU
        # interpreter types (bool tensor & bool scalar) as int32, which it then refuses as a load mask
        valid = (tok < hi) & (phys + 0 * offs_n >= 0) & (st + 0 * offs_n < 0)
        phys64 = tl.maximum(phys, 0).to(tl.int64)
        rows = phys64 * stride_kn + kvh * stride_kh + (tok % BS) * stride_ks
        srows = phys64 * stride_sn + kvh * stride_sh + tok % BS
        cp = phys64 * stride_cn + kvh * stride_ch + offs_d  # [BLOCK_DH] this block's channel scales
        s_lo = tl.load(ks_ptr + cp, mask=d_mask, other=0.0).to(tl.float32)
        s_hi = tl.load(ks_ptr + DH + cp, mask=d_mask, other=0.0).to(tl.float32)
        z_lo = tl.load(kz_ptr + cp, mask=d_mask, other=0.0).to(tl.float32)
        z_hi = tl.load(kz_ptr + DH + cp, mask=d_mask, other=0.0).to(tl.float32)
        bias = tl.sum(qt_lo * z_lo[:, None] + qt_hi * z_hi[:, None], axis=0)  # [BLOCK_G] q . z (fp32)
        qs_lo = (qt_lo * s_lo[:, None]).to(CDT)
        qs_hi = (qt_hi * s_hi[:, None]).to(CDT)
        c_lo, c_hi = _codes4(k_ptr, rows, valid, offs_d, d_mask, BLOCK_N, BLOCK_DH, CDT, ASM, WORDS)
        sc = tl.dot(c_hi, qs_hi, tl.dot(c_lo, qs_lo)) + bias[None, :]  # [BLOCK_N, BLOCK_G]
        sc = tl.where(valid[:, None], sc * qk_scale, float("-inf"))
        pt, alpha, m_i, l_i = _online_update(sc, m_i, l_i)
        vs = tl.load(vs_ptr + srows, mask=valid, other=0.0).to(tl.float32)
        vz = tl.load(vz_ptr + srows, mask=valid, other=0.0).to(tl.float32)
        z_i = z_i * alpha + tl.sum(pt * vz[:, None], axis=0)
        pv = (pt * vs[:, None]).to(CDT)  # (p * vs)^T, range as in triton_kvtile.fold_v_weights
        v_lo, v_hi = _codes4(v_ptr, rows, valid, offs_d, d_mask, BLOCK_N, BLOCK_DH, CDT, ASM, WORDS)
        acc_lo = tl.dot(tl.trans(v_lo), pv, acc_lo * alpha[None, :])
        acc_hi = tl.dot(tl.trans(v_hi), pv, acc_hi * alpha[None, :])

    # staged tokens in full precision with the plain query: normally the newest block only
    t_lo = tl.where(tl.max(early, axis=0) > 0, lo, tl.maximum(lo, newest))
    offs_t = tl.arange(0, TAIL_N)
    qc_lo = qt_lo.to(CDT)
    qc_hi = qt_hi.to(CDT)
    for start in range(t_lo, hi, TAIL_N):
        tok = start + offs_t
        valid, rows, phys = tile_rows(bt_row, tok, hi, kvh, stride_kn, stride_kh, stride_ks, BS)
        crows, strows, stg = stage_rows(stage_ptr, phys, valid, tok, kvh, stride_cn, stride_ch, stride_stn,
                                        stride_sth, BS, D)
        vm = stg[:, None] & d_mask[None, :]  # [TAIL_N, BLOCK_DH]
        k_lo = tl.load(kst_ptr + strows[:, None] + offs_d[None, :], mask=vm, other=0.0).to(CDT)
        k_hi = tl.load(kst_ptr + strows[:, None] + DH + offs_d[None, :], mask=vm, other=0.0).to(CDT)
        sc = tl.dot(k_hi, qc_hi, tl.dot(k_lo, qc_lo))
        pt, alpha, m_i, l_i = _online_update(tl.where(stg[:, None], sc * qk_scale, float("-inf")), m_i, l_i)
        z_i = z_i * alpha
        v_lo = tl.load(vst_ptr + strows[:, None] + offs_d[None, :], mask=vm, other=0.0).to(CDT)
        v_hi = tl.load(vst_ptr + strows[:, None] + DH + offs_d[None, :], mask=vm, other=0.0).to(CDT)
        pc = pt.to(CDT)
        acc_lo = tl.dot(tl.trans(v_lo), pc, acc_lo * alpha[None, :])
        acc_hi = tl.dot(tl.trans(v_hi), pc, acc_hi * alpha[None, :])

    store_decode(tl.trans(acc_lo) + z_i[:, None], tl.trans(acc_hi) + z_i[:, None], m_i, l_i, offs_g, kvh, seq,
                 split, num_splits, out_ptr, part_o_ptr, part_ml_ptr, stride_ot, stride_oh, D, DH, G, BLOCK_DH,
                 SPLIT)
