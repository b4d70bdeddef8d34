"""Paged int8 decode with the products transposed ("swap AB"): tokens on the MMA's M side.

The untransposed decode (triton_decode) pads the G query heads of a KV group to 16 MMA rows, so at
G = 2 most of each score tile and of the [16, D] fp32 accumulator is padding. Here both products
are written the other way round, as in TensorRT-LLM's and FlashInfer's small-group decode:

    s^T [BLOCK_N, G] = K [BLOCK_N, D] @ q^T [D, G]          (K codes are the A operand)
    o^T [D, G]      += V^T [D, BLOCK_N] @ (p * vs)^T [BLOCK_N, G]

G sits on the MMA's N side, which the compiler pads to 8, not 16: the accumulator is [D, 8] and a
tile needs half the MMA instructions. Same cache format, same folds (K scales on the score rows,
V scales into the softmax weights) and split-K contract as triton_decode.

Codes are loaded as int8 tiles and converted in registers (triton_dequant.int8_tile_f16). The
compiler then copies them to shared memory as they are (16-byte cp.async, pipelined) and reads
them straight into the operand layout (ldmatrix), with no fp16 round trip through shared memory.
That needs both operands "K-contiguous": key rows are (dims along the score product's inner
size), and int8 values are stored dims-major per block (nanokv.kv.cache) so the V^T tile has
tokens, the PV product's inner size, contiguous. One tile lies in one block (BS % BLOCK_N == 0,
part of runs_transposed), so each V^T row is BLOCK_N contiguous bytes (16 by default).
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanokv.kernels.triton_dequant import int8_tile_f16
from nanokv.kernels.triton_kvtile import split_range
from nanokv.kernels.triton_softmax import merge_if_last, softmax_update_t, store_decode


def runs_transposed(bits: int, swap_block_n: int, words: bool = True, block_size: int = 16,
                    int4: bool = False) -> bool:
    """Whether a decode goes to this kernel (int8) or its int4 counterpart (triton_decode_swap4, when
    `int4`): fp16 compute (`words`, as the untransposed kernels' word reads need), tiles of >= 16
    tokens (the PV product's inner size, the tensor-core dot's minimum) inside one block. The one rule
    for the launch (triton_decode.paged_decode) and the split count (triton_backend.choose_splits)."""
    return (bits == 8 or (bits == 4 and int4)) and words and swap_block_n >= 16 and block_size % swap_block_n == 0


@triton.jit
def _tile_meta(bt_row, ks_ptr, vs_ptr, start, hi, kvh, stride_sn, stride_sh, offs_n, BS: tl.constexpr):
    """(physical block, K scales, V scales) of the tile at token `start` (one block): block -1 and
    scales 0 where the tile is past hi or a hole."""
    phys = tl.load(bt_row + start // BS, mask=start < hi, other=-1)
    valid = (start + offs_n < hi) & (phys + 0 * offs_n >= 0)
    srows = tl.maximum(phys, 0).to(tl.int64) * stride_sn + kvh * stride_sh + start % BS + offs_n
    return phys, tl.load(ks_ptr + srows, mask=valid, other=0.0), tl.load(vs_ptr + srows, mask=valid, other=0.0)


# metadata pointers and sizes vary step to step: not specialized on (see triton_decode)
@triton.jit(do_not_specialize=["bt_ptr", "seq_lens_ptr", "num_splits", "stride_bt", "count_ptr"])
def decode_int8_swap_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, kst_ptr, vst_ptr, stage_ptr, bt_ptr, seq_lens_ptr,
    out_ptr, part_o_ptr, part_ml_ptr,
    qk_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kn, stride_kh, stride_ks, stride_sn, stride_sh, stride_bt,
    stride_cn, stride_ch, stride_stn, stride_sth, count_ptr,
    D: tl.constexpr, DH: tl.constexpr, G: tl.constexpr, BS: tl.constexpr,
    CDT: tl.constexpr, ASM: tl.constexpr, WORDS: tl.constexpr, FOLD_V: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    LAZY_TAU: tl.constexpr, MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # argument list of triton_decode._decode_kernel (one launch site); zero points, staging, WORDS
    # and LAZY_TAU are unused here. k_ptr / v_ptr: the int8 codes (v dims-major per block).
    # MERGE: the splits are merged here (merge_if_last; count_ptr its counters, BLOCK_S >= num_splits)
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

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_lo = tl.zeros([BLOCK_DH, BLOCK_G], tl.float32)  # o^T halves
    acc_hi = tl.zeros([BLOCK_DH, BLOCK_G], tl.float32)
    bt_row = bt_ptr + seq * stride_bt
    # The tile's block and its per-token scales are loaded one tile ahead (registers, loop-carried):
    # loaded in the tile that uses them, their latency stalled every tile (H200 profile: 18% of the
    # kernel's stall samples on the scales' first use); the codes come through the compiler's
    # cp.async pipeline instead.
    phys_n, ks_n, vs_n = _tile_meta(bt_row, ks_ptr, vs_ptr, lo, hi, kvh, stride_sn, stride_sh, offs_n, BS)
    for start in range(lo, hi, BLOCK_N):  # lo, hi: whole tiles (split_range), so start % BLOCK_N == 0
        phys_s, ks, vs = phys_n, ks_n, vs_n  # this tile's block (-1: hole) and scales (0 where invalid)
        phys_n, ks_n, vs_n = _tile_meta(bt_row, ks_ptr, vs_ptr, start + BLOCK_N, hi, kvh, stride_sn, stride_sh,
                                        offs_n, BS)
        # (phys_s + 0 * offs_n): broadcast before comparing; the CPU interpreter types a bool
        # tensor & bool scalar as int32, which it then refuses as a load mask
        valid = (start + offs_n < hi) & (phys_s + 0 * offs_n >= 0)
        base = tl.maximum(phys_s, 0).to(tl.int64) * stride_kn + kvh * stride_kh  # K, V codes: same n/h strides
        tin = tl.multiple_of(start % BS, BLOCK_N) + offs_n  # [BLOCK_N] token offsets in the block
        # codes are not masked: an invalid token's row is still inside the cache (block 0 for a
        # hole), its codes are finite, and its score is set to -inf below (so its p is 0)
        kp = k_ptr + base + tin[:, None] * stride_ks + offs_d[None, :]  # K [BLOCK_N, BLOCK_DH] rows
        k_lo = int8_tile_f16(tl.load(kp), ASM)
        k_hi = int8_tile_f16(tl.load(kp + DH), ASM)
        st = tl.dot(k_hi, qt_hi, tl.dot(k_lo, qt_lo))  # [BLOCK_N, BLOCK_G] fp32 scores (codes)
        st = tl.where(valid[:, None], st * (ks.to(tl.float32) * qk_scale)[:, None], float("-inf"))
        pt, alpha, m_i, l_i = softmax_update_t(st, m_i, l_i)  # pt [BLOCK_N, BLOCK_G]
        pv = (pt * vs.to(tl.float32)[:, None]).to(CDT)  # (p * vs)^T, range as in fold_v_weights
        vp = v_ptr + base + offs_d[:, None] * BS + tin[None, :]  # V^T [BLOCK_DH, BLOCK_N], dims-major block
        v_lo = int8_tile_f16(tl.load(vp), ASM)
        v_hi = int8_tile_f16(tl.load(vp + DH * BS), ASM)
        acc_lo = tl.dot(v_lo, pv, acc_lo * alpha[None, :])
        acc_hi = tl.dot(v_hi, pv, acc_hi * alpha[None, :])

    store_decode(tl.trans(acc_lo), tl.trans(acc_hi), m_i, l_i, offs_g, kvh, seq, split, num_splits, out_ptr,
                 part_o_ptr, part_ml_ptr, stride_ot, stride_oh, D, DH, G, BLOCK_DH, SPLIT)
    if MERGE:
        merge_if_last(count_ptr, part_o_ptr, part_ml_ptr, out_ptr, seq, kvh, num_splits, stride_ot, stride_oh,
                      D, G, BLOCK_S, 2 * BLOCK_DH)
