"""Paged int4 decode with the products transposed: tokens on the MMA's M side, as triton_decode_swap.

    s^T [BLOCK_N, G] = K codes [BLOCK_N, D] @ (q * s_k)^T [D, G] + q . z_k
    o^T [D, G]      += V^T codes [D, BLOCK_N] @ (p * vs)^T [BLOCK_N, G]     (+ sum_n p_n vz_n, at the end)

A tile lies in one block (BLOCK_N divides the block size), so the block's per-channel key scale s_k
and zero z_k (KIVI, nanokv.kv.cache) fold into one scaled query and one bias per tile: the codes
enter the dot as they are (exact in fp16). Per-token value scales fold into the softmax weights and
the value zero points into one running sum per head (triton_decode_int4's folds).

Codes are loaded as uint8 tiles and split into their two nibbles in registers (int4_tile_f16), so
the compiler copies them to shared memory as they are and reads them straight into the operand
layout when the summed dimension is contiguous in memory: dims for keys, tokens for values (values
stored dims-major per block, nanokv.kv.cache). The value strides are arguments, so the kernel also
reads token-major values (a transposing gather: 345 vs 298 us at the long-context decode batch on an
H200, docs/kernels.md "The int4 decode").

Open blocks (full-precision staging, nanokv.kv.staging) are scored in a second loop as in
triton_decode_int4: in a decode step only a sequence's newest block is staged; the main loop masks
staged tiles, and if it meets one before the newest block the second loop covers the whole split.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanokv.kernels.triton_dequant import int4_tile_f16
from nanokv.kernels.triton_kvtile import split_range
from nanokv.kernels.triton_softmax import merge_if_last, softmax_update_t, store_decode


@triton.jit
def _tile_block(bt_row, stage_ptr, start, hi, BS: tl.constexpr):
    """The tile at token `start` (inside one block): (physical block, or -1 past hi / hole / staged;
    1 if the block is staged, else 0)."""
    phys = tl.load(bt_row + start // BS, mask=start < hi, other=-1)
    slot = tl.load(stage_ptr + tl.maximum(phys, 0), mask=phys >= 0, other=-1)
    return tl.where(slot >= 0, -1, phys), (slot >= 0).to(tl.int32)


@triton.jit
def _tile_scales(phys, ks_ptr, kz_ptr, vs_ptr, vz_ptr, start, hi, kvh, stride_sn, stride_sh, stride_cn, stride_ch,
                 offs_n, offs_d, DH: tl.constexpr, BS: tl.constexpr):
    """Block phys's key scale and zero halves [BLOCK_DH] and the tile's value scales and zeros
    [BLOCK_N], fp16; zeros where phys < 0 or past hi."""
    # (phys + 0 * offs): broadcast before comparing, as in triton_decode_swap (the CPU interpreter)
    crow = tl.maximum(phys, 0).to(tl.int64) * stride_cn + kvh * stride_ch + offs_d
    dm = (offs_d < DH) & (phys + 0 * offs_d >= 0)
    ks_lo = tl.load(ks_ptr + crow, mask=dm, other=0.0)
    ks_hi = tl.load(ks_ptr + crow + DH, mask=dm, other=0.0)
    kz_lo = tl.load(kz_ptr + crow, mask=dm, other=0.0)
    kz_hi = tl.load(kz_ptr + crow + DH, mask=dm, other=0.0)
    nm = (start + offs_n < hi) & (phys + 0 * offs_n >= 0)
    srow = tl.maximum(phys, 0).to(tl.int64) * stride_sn + kvh * stride_sh + start % BS + offs_n
    return ks_lo, ks_hi, kz_lo, kz_hi, tl.load(vs_ptr + srow, mask=nm, other=0.0), tl.load(vz_ptr + srow, mask=nm,
                                                                                          other=0.0)


# metadata pointers and sizes vary step to step: not specialized on (see triton_decode)
@triton.jit(do_not_specialize=["bt_ptr", "seq_lens_ptr", "num_splits", "stride_bt", "count_ptr"])
def decode_int4_swap_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, kst_ptr, vst_ptr, stage_ptr, bt_ptr, seq_lens_ptr,
    out_ptr, part_o_ptr, part_ml_ptr,
    qk_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kn, stride_kh, stride_ks, stride_sn, stride_sh, stride_bt,
    stride_cn, stride_ch, stride_stn, stride_sth, count_ptr, stride_vd, stride_vt,
    D: tl.constexpr, DH: tl.constexpr, G: tl.constexpr, BS: tl.constexpr,
    CDT: tl.constexpr, ASM: tl.constexpr, WORDS: tl.constexpr, FOLD_V: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    LAZY_TAU: tl.constexpr, MERGE: tl.constexpr, BLOCK_S: tl.constexpr, PREFETCH: tl.constexpr,
):
    # argument list of triton_decode._decode_kernel plus the merge counters and the value codes'
    # (dim, token) strides; k_ptr / v_ptr: uint8 codes (byte j = dims j and j + DH). WORDS, FOLD_V and
    # LAZY_TAU are unused (both folds always on). DH must equal BLOCK_DH (a power of 2 >= 16).
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, lo, hi = split_range(seq_lens_ptr, seq, split, num_splits, BLOCK_N)
    newest = (tl.maximum(seq_len - 1, 0) // BS) * BS  # first position of the newest (open) block

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_DH)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * G + offs_g
    qt_rows = q_ptr + seq * stride_qt + heads[None, :] * stride_qh + offs_d[:, None]
    qm = (offs_g < G)[None, :] & (offs_d < DH)[:, None]
    qt_lo = tl.load(qt_rows, mask=qm, other=0.0).to(tl.float32)  # [BLOCK_DH, BLOCK_G]: q^T halves
    qt_hi = tl.load(qt_rows + DH, mask=qm, other=0.0).to(tl.float32)
    qc_lo = qt_lo.to(CDT)
    qc_hi = qt_hi.to(CDT)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    z_i = tl.zeros([BLOCK_G], tl.float32)  # sum_n p_n vz_n: added to every output dim at the end
    acc_lo = tl.zeros([BLOCK_DH, BLOCK_G], tl.float32)  # o^T halves
    acc_hi = tl.zeros([BLOCK_DH, BLOCK_G], tl.float32)
    bt_row = bt_ptr + seq * stride_bt
    early = lo * 0  # a staged tile met before the newest block (tests stage at will; decode steps do not)
    # PREFETCH 1: each tile's block-table entry and staging slot are loaded one tile ahead (they head
    # a chain of dependent loads); 2: its scales and zeros too (more registers)
    phys_n, stg_n = _tile_block(bt_row, stage_ptr, lo, hi, BS)
    ksl_n, ksh_n, kzl_n, kzh_n, vs_n, vz_n = _tile_scales(phys_n, ks_ptr, kz_ptr, vs_ptr, vz_ptr, lo, hi, kvh,
                                                          stride_sn, stride_sh, stride_cn, stride_ch, offs_n, offs_d,
                                                          DH, BS)
    for start in range(lo, hi, BLOCK_N):  # whole tiles (split_range): start % BLOCK_N == 0
        if PREFETCH >= 1:
            phys, staged = phys_n, stg_n
            phys_n, stg_n = _tile_block(bt_row, stage_ptr, start + BLOCK_N, hi, BS)
        else:
            phys, staged = _tile_block(bt_row, stage_ptr, start, hi, BS)
        if PREFETCH >= 2:
            ks_lo, ks_hi, kz_lo, kz_hi, vs, vz = ksl_n, ksh_n, kzl_n, kzh_n, vs_n, vz_n
            ksl_n, ksh_n, kzl_n, kzh_n, vs_n, vz_n = _tile_scales(
                phys_n, ks_ptr, kz_ptr, vs_ptr, vz_ptr, start + BLOCK_N, hi, kvh, stride_sn, stride_sh, stride_cn,
                stride_ch, offs_n, offs_d, DH, BS)
        else:
            ks_lo, ks_hi, kz_lo, kz_hi, vs, vz = _tile_scales(
                phys, ks_ptr, kz_ptr, vs_ptr, vz_ptr, start, hi, kvh, stride_sn, stride_sh, stride_cn, stride_ch,
                offs_n, offs_d, DH, BS)
        early = early | (staged * (start < newest).to(tl.int32))
        valid = (start + offs_n < hi) & (phys + 0 * offs_n >= 0)
        base = tl.maximum(phys, 0).to(tl.int64) * stride_kn + kvh * stride_kh
        tin = tl.multiple_of(start % BS, BLOCK_N) + offs_n  # [BLOCK_N] token offsets in the block
        # codes not masked: an invalid token's row is inside the cache, its codes finite, its p 0
        k_lo, k_hi = int4_tile_f16(tl.load(k_ptr + base + tin[:, None] * stride_ks + offs_d[None, :]), ASM)
        # q * s in fp16 (q fp16 or bf16, exact in fp16 in the range the kernels assume; the fp32
        # product rounded once is the same number); the bias q . z in fp32: a channel's zero point
        # can be far larger than its step
        qs_lo = qc_lo * ks_lo.to(CDT)[:, None]  # [BLOCK_DH, BLOCK_G]
        qs_hi = qc_hi * ks_hi.to(CDT)[:, None]
        bias = tl.sum(qt_lo * kz_lo.to(tl.float32)[:, None] + qt_hi * kz_hi.to(tl.float32)[:, None], axis=0)
        st = tl.dot(k_hi, qs_hi, tl.dot(k_lo, qs_lo)) + bias[None, :]  # [BLOCK_N, BLOCK_G] fp32
        st = tl.where(valid[:, None], st * qk_scale, float("-inf"))
        pt, alpha, m_i, l_i = softmax_update_t(st, m_i, l_i)  # pt [BLOCK_N, BLOCK_G]
        z_i = z_i * alpha + tl.sum(pt * vz.to(tl.float32)[:, None], axis=0)
        pv = (pt * vs.to(tl.float32)[:, None]).to(CDT)  # (p * vs)^T, range as in fold_v_weights
        vb = tl.load(v_ptr + base + offs_d[:, None] * stride_vd + tin[None, :] * stride_vt)  # [BLOCK_DH, BLOCK_N]
        v_lo, v_hi = int4_tile_f16(vb, ASM)
        acc_lo = tl.dot(v_lo, pv, acc_lo * alpha[None, :])
        acc_hi = tl.dot(v_hi, pv, acc_hi * alpha[None, :])

    # staged tokens in full precision (plain q): the newest block, or the whole split (see above)
    for start in range(tl.where(early > 0, lo, tl.maximum(lo, newest)), hi, BLOCK_N):
        phys = tl.load(bt_row + start // BS)
        slot = tl.load(stage_ptr + tl.maximum(phys, 0), mask=phys >= 0, other=-1)
        staged = (start + offs_n < hi) & (slot + 0 * offs_n >= 0)
        srow = tl.maximum(slot, 0).to(tl.int64) * stride_stn + kvh * stride_sth + (start % BS + offs_n) * D
        sm = staged[:, None] & (offs_d < DH)[None, :]  # [BLOCK_N, BLOCK_DH]
        k_lo = tl.load(kst_ptr + srow[:, None] + offs_d[None, :], mask=sm, other=0.0).to(CDT)
        k_hi = tl.load(kst_ptr + srow[:, None] + DH + offs_d[None, :], mask=sm, other=0.0).to(CDT)
        st = tl.dot(k_hi, qc_hi, tl.dot(k_lo, qc_lo))
        st = tl.where(staged[:, None], st * qk_scale, float("-inf"))
        pt, alpha, m_i, l_i = softmax_update_t(st, m_i, l_i)
        z_i = z_i * alpha
        smt = (offs_d < DH)[:, None] & staged[None, :]  # [BLOCK_DH, BLOCK_N]
        v_lo = tl.load(vst_ptr + srow[None, :] + offs_d[:, None], mask=smt, other=0.0).to(CDT)
        v_hi = tl.load(vst_ptr + srow[None, :] + DH + offs_d[:, None], mask=smt, other=0.0).to(CDT)
        pc = pt.to(CDT)
        acc_lo = tl.dot(v_lo, pc, acc_lo * alpha[None, :])
        acc_hi = tl.dot(v_hi, pc, acc_hi * alpha[None, :])

    acc_lo = acc_lo + z_i[None, :]
    acc_hi = acc_hi + z_i[None, :]
    store_decode(tl.trans(acc_lo), tl.trans(acc_hi), m_i, l_i, offs_g, kvh, seq, split, num_splits, out_ptr,
                 part_o_ptr, part_ml_ptr, stride_ot, stride_oh, D, DH, G, BLOCK_DH, SPLIT)
    if MERGE:
        merge_if_last(count_ptr, part_o_ptr, part_ml_ptr, out_ptr, seq, kvh, num_splits, stride_ot, stride_oh,
                      D, G, BLOCK_S, 2 * BLOCK_DH)
