"""Paged decode for the int4 block format with the key dequantization folded into the query.

int4 keys have one scale s and zero z per (block, head, channel) (KIVI, nanokv.kv.cache), so for
the tokens n of one block
    q . k_n = sum_d q_d (s_d c_nd + z_d) = (q * s) . c_n + q . z
one scaled query [G, D] and one bias per (block, head) replace the per-element dequantization of
the [bs, D] key tile: the codes enter the dot as they are (small integers, exact in fp16).
Values (per-token scale and zero) fold into the softmax weights the same way (FOLD_V):
    sum_n p_n (vs_n c_n + vz_n) = (p * vs) @ c + sum_n p_n vz_n    (the last term the same for all d)

Row groups. The G query heads of a KV group are padded to BLOCK_G >= 16 rows for the tensor
cores, so with G = 2 most rows would idle. Here row r = j * ROWG + g holds head g scaled for block
j of the tile: one [BLOCK_G, D] x [D, BLOCK_N] dot scores BLOCK_N / bs blocks, and row group j's
scores outside block j are masked. Each row group runs its own online softmax over its own blocks
(an in-program split-K) and the groups are merged at the end like splits.

Open blocks. A block is quantized once, when it fills (nanokv.kv.blockquant); until then it is
read from full-precision staging. In a decode step only a sequence's newest block can be open:
every block written before is full, and a block that fills in step t is quantized after step t's
attention and released by StageTable.finish. The main loop therefore reads codes only and masks
staged tokens; a second loop reads staged tokens from staging over [newest block start, hi), or over
the whole split when the main loop met a staged token before the newest block (any staging layout
stays correct, at the cost of one more pass).
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanokv.kernels.triton_dequant import int4_tile_f16
from nanokv.kernels.triton_kvtile import (
    fold_v_weights,
    int4_value_codes,
    split_range,
    stage_rows,
    tile_rows,
)
from nanokv.kernels.triton_softmax import decode_softmax_step, softmax_update, store_decode


@triton.jit
def _codes4(c_ptr, rows, valid, offs_d, d_mask, CDT: tl.constexpr, ASM: tl.constexpr):
    """int4 key tile as two [BLOCK_N, BLOCK_DH] halves in the compute dtype (codes 0..15, exact): a
    uint8 tile split in registers, as triton_decode_swap4 reads it (both int4 kernels take the codes
    as stored)."""
    packed = tl.load(c_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0)
    if CDT == tl.float16:
        return int4_tile_f16(packed, ASM)
    else:
        return (packed & 15).to(CDT), (packed >> 4).to(CDT)


@triton.jit
def _fold_query(q_lo, q_hi, ks_ptr, kz_ptr, bt_row, blk_r, used, hi, kvh, stride_cn, stride_ch, offs_d, d_mask,
                DH: tl.constexpr, BS: tl.constexpr, CDT: tl.constexpr):
    """Per-row scaled query and bias for the row groups' blocks blk_r [BLOCK_G] (logical indices;
    `used` [BLOCK_G]: the tile has that block).

    q_lo, q_hi: [BLOCK_G, BLOCK_DH] fp32. Returns (q * s) halves in CDT and q . z [BLOCK_G] fp32.
    fp32 products: a channel's zero can be far larger than its step (the bias keeps it exactly).
    Rows whose block is past the context read zeros (their scores are masked by the caller).
    """
    phys = tl.load(bt_row + blk_r, mask=(blk_r * BS < hi) & used, other=-1)
    crow = tl.where(phys >= 0, phys, 0).to(tl.int64) * stride_cn + kvh * stride_ch  # [BLOCK_G]
    cm = (phys >= 0)[:, None] & d_mask[None, :]
    cp = crow[:, None] + offs_d[None, :]
    s_lo = tl.load(ks_ptr + cp, mask=cm, other=0.0).to(tl.float32)
    s_hi = tl.load(ks_ptr + DH + cp, mask=cm, other=0.0).to(tl.float32)
    z_lo = tl.load(kz_ptr + cp, mask=cm, other=0.0).to(tl.float32)
    z_hi = tl.load(kz_ptr + DH + cp, mask=cm, other=0.0).to(tl.float32)
    bias = tl.sum(q_lo * z_lo + q_hi * z_hi, axis=1)
    return (q_lo * s_lo).to(CDT), (q_hi * s_hi).to(CDT), bias


# metadata pointers and sizes vary step to step: not specialized on (see triton_decode)
@triton.jit(do_not_specialize=["bt_ptr", "seq_lens_ptr", "num_splits", "stride_bt"])
def decode_int4_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, kst_ptr, vst_ptr, stage_ptr, bt_ptr, seq_lens_ptr,
    out_ptr, part_o_ptr, part_ml_ptr,
    qk_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kn, stride_kh, stride_ks, stride_sn, stride_sh, stride_bt,
    stride_cn, stride_ch, stride_stn, stride_sth,
    D: tl.constexpr, DH: tl.constexpr, G: tl.constexpr, BS: tl.constexpr,
    CDT: tl.constexpr, ASM: tl.constexpr, WORDS: tl.constexpr, FOLD_V: tl.constexpr,
    ROWG: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_N: tl.constexpr,
    TAIL_N: tl.constexpr, SPLIT: tl.constexpr, LAZY_TAU: tl.constexpr,
):
    # ROWG = next_pow2(G) rows per row group, BLOCK_G // ROWG groups >= BLOCK_N // BS blocks per tile
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, lo, hi = split_range(seq_lens_ptr, seq, split, num_splits, BLOCK_N)
    newest = (tl.maximum(seq_len - 1, 0) // BS) * BS  # first position of the newest (open) block

    offs_r = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_DH)
    offs_n = tl.arange(0, BLOCK_N)
    j_r = offs_r // ROWG  # [BLOCK_G] block of the tile this row scores
    g_r = offs_r % ROWG  # query head within the KV group
    d_mask = offs_d < DH
    qm = (g_r < G)[:, None] & d_mask[None, :]
    q_rows = q_ptr + seq * stride_qt + (kvh * G + g_r)[:, None] * stride_qh + offs_d[None, :]
    q_lo = tl.load(q_rows, mask=qm, other=0.0).to(tl.float32)  # [BLOCK_G, BLOCK_DH], repeated per group
    q_hi = tl.load(q_rows + DH, mask=qm, other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    z_i = tl.zeros([BLOCK_G], tl.float32)  # FOLD_V: sum_n p_n vz_n, added to every output dim at the end
    acc_lo = tl.zeros([BLOCK_G, BLOCK_DH], tl.float32)
    acc_hi = tl.zeros([BLOCK_G, BLOCK_DH], tl.float32)
    bt_row = bt_ptr + seq * stride_bt
    jc = offs_n // BS  # [BLOCK_N] block of the tile each column is in (all 0 when BLOCK_N <= BS)
    used = (j_r == 0) | (j_r * BS < BLOCK_N)  # [BLOCK_G] row groups with a block (more when BLOCK_G allows)
    early = tl.zeros([BLOCK_N], tl.int32)  # staged tokens seen before the newest block
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n
        phys = tl.load(bt_row + tok // BS, mask=tok < hi, other=-1)
        st = tl.load(stage_ptr + phys, mask=phys >= 0, other=-1)
        valid = (phys >= 0) & (st < 0)  # quantized tokens only; staged ones are the second loop's
        early = early | ((st >= 0) & (tok < newest)).to(tl.int32)
        phys64 = tl.where(valid, phys, 0).to(tl.int64)
        rows = phys64 * stride_kn + kvh * stride_kh + (tok % BS) * stride_ks
        srows = phys64 * stride_sn + kvh * stride_sh + tok % BS
        qs_lo, qs_hi, bias = _fold_query(q_lo, q_hi, ks_ptr, kz_ptr, bt_row, start // BS + j_r, used, hi, kvh,
                                         stride_cn, stride_ch, offs_d, d_mask, DH, BS, CDT)
        c_lo, c_hi = _codes4(k_ptr, rows, valid, offs_d, d_mask, CDT, ASM)
        s = tl.dot(qs_hi, tl.trans(c_hi), tl.dot(qs_lo, tl.trans(c_lo))) + bias[:, None]
        own = (jc[None, :] == j_r[:, None]) & valid[None, :]  # [BLOCK_G, BLOCK_N]
        s = tl.where(own, s * qk_scale, float("-inf"))
        p, alpha, m_i, l_i, acc_lo, acc_hi = decode_softmax_step(s, m_i, l_i, acc_lo, acc_hi, LAZY_TAU)
        v_lo, v_hi = int4_value_codes(v_ptr, bt_row, start, hi, kvh, stride_kn, stride_kh, offs_d, d_mask, BS,
                                      BLOCK_N, CDT, ASM)  # (dims-major blocks; staged tokens' p is 0)
        vs = tl.load(vs_ptr + srows, mask=valid, other=0.0)  # [BLOCK_N] fp16
        vz = tl.load(vz_ptr + srows, mask=valid, other=0.0)
        if FOLD_V:
            pv = fold_v_weights(p, vs, CDT)
            z_i = z_i * alpha + tl.sum(p * vz.to(tl.float32)[None, :], axis=1)
        else:  # per-element dequantization in the compute dtype (the generic path's math)
            pv = p.to(CDT)
            v_lo = v_lo * vs.to(CDT)[:, None] + vz.to(CDT)[:, None]
            v_hi = v_hi * vs.to(CDT)[:, None] + vz.to(CDT)[:, None]
        acc_lo = tl.dot(pv, v_lo, acc_lo)
        acc_hi = tl.dot(pv, v_hi, acc_hi)

    # staged tokens in full precision, scored by row group 0 (plain q): normally the newest block only
    s_lo = tl.where(tl.max(early, axis=0) > 0, lo, tl.maximum(lo, newest))
    offs_t = tl.arange(0, TAIL_N)
    qc_lo = q_lo.to(CDT)
    qc_hi = q_hi.to(CDT)
    for start in range(s_lo, hi, TAIL_N):
        tok = start + offs_t
        valid, rows, phys = tile_rows(bt_row, tok, hi, kvh, stride_kn, stride_kh, stride_ks, BS)
        crows, strows, staged = stage_rows(stage_ptr, phys, valid, tok, kvh, stride_cn, stride_ch, stride_stn,
                                           stride_sth, BS, D)
        vm = staged[:, None] & d_mask[None, :]  # [TAIL_N, BLOCK_DH]
        k_lo = tl.load(kst_ptr + strows[:, None] + offs_d[None, :], mask=vm, other=0.0).to(CDT)
        k_hi = tl.load(kst_ptr + strows[:, None] + DH + offs_d[None, :], mask=vm, other=0.0).to(CDT)
        s = tl.dot(qc_hi, tl.trans(k_hi), tl.dot(qc_lo, tl.trans(k_lo)))
        own = (j_r == 0)[:, None] & staged[None, :]
        p, alpha, m_i, l_i = softmax_update(tl.where(own, s * qk_scale, float("-inf")), m_i, l_i)
        z_i = z_i * alpha
        v_lo = tl.load(vst_ptr + strows[:, None] + offs_d[None, :], mask=vm, other=0.0).to(CDT)
        v_hi = tl.load(vst_ptr + strows[:, None] + DH + offs_d[None, :], mask=vm, other=0.0).to(CDT)
        pc = p.to(CDT)
        acc_lo = tl.dot(pc, v_lo, acc_lo * alpha[:, None])
        acc_hi = tl.dot(pc, v_hi, acc_hi * alpha[:, None])

    acc_lo = acc_lo + z_i[:, None]
    acc_hi = acc_hi + z_i[:, None]
    KB: tl.constexpr = BLOCK_G // ROWG
    if KB > 1:  # merge the row groups per head: weights 2^(m_j - max_j m_j), empty groups weigh 0
        m2 = tl.reshape(m_i, [KB, ROWG])
        m_g = tl.max(m2, axis=0)  # [ROWG]
        w = tl.exp2(m2 - tl.where(m_g == float("-inf"), 0.0, m_g)[None, :])  # [KB, ROWG]
        l_g = tl.sum(w * tl.reshape(l_i, [KB, ROWG]), axis=0)
        a_lo = tl.sum(tl.reshape(acc_lo, [KB, ROWG, BLOCK_DH]) * w[:, :, None], axis=0)
        a_hi = tl.sum(tl.reshape(acc_hi, [KB, ROWG, BLOCK_DH]) * w[:, :, None], axis=0)
        store_decode(a_lo, a_hi, m_g, l_g, tl.arange(0, ROWG), kvh, seq, split, num_splits, out_ptr, part_o_ptr,
                     part_ml_ptr, stride_ot, stride_oh, D, DH, G, BLOCK_DH, SPLIT)
    else:
        store_decode(acc_lo, acc_hi, m_i, l_i, offs_r, kvh, seq, split, num_splits, out_ptr, part_o_ptr,
                     part_ml_ptr, stride_ot, stride_oh, D, DH, G, BLOCK_DH, SPLIT)


def int4_tiles(G: int, block_size: int, block_n: int, min_rows: int = 16) -> dict[str, int]:
    """Launch constants of the folded int4 decode: ROWG rows per row group (G padded to a power of
    2), one group per block of the tile, BLOCK_G >= min_rows (below 16 Triton pads the MMA rows
    itself, with fewer accumulator registers), TAIL_N tokens per staged-tile (>= 16 for the dot,
    <= 64 to bound registers)."""
    rowg = triton.next_power_of_2(G)
    return {"ROWG": rowg, "BLOCK_G": max(min_rows, rowg * max(1, block_n // block_size)),
            "TAIL_N": max(16, min(block_size, 64))}
