"""Hybrid-sparsity decode one KV block at a time: a scalar branch per block on its table entry.

The tile kernel (triton_hybrid, triton_hybrid_tile) reads both sources on every tile, masked, and
converts and multiplies both, although a block is one kind. Here a tile lies inside one block
(BLOCK_N divides the block size), so its entry e is one scalar and the block is read only as what
it is (entry encoding: triton_hybrid_tile):
    e >= 0    int8 pool block: codes and per-row scales, as triton_decode_swap reads them
    e <= -2   INT4 store slot -2 - e: nibbles, per-row scale and zero (folded as triton_hybrid_tile)
    e == -1   a hole: nothing is loaded and the softmax state is left as it is
Products transposed as in triton_decode_swap (tokens on the MMA's M side, the G query heads of a
KV group on its N side, padded to 8 rather than 16 rows):
    s^T [BLOCK_N, G] = K codes @ q^T * scale (+ sum_d q * zero, store rows)
    o^T [D, G]      += V^T codes @ (p * scale)^T (+ p . zero on every dim, store rows, kept apart)
The entry of the next tile is loaded one tile ahead (it heads every load of the tile). Loads sit
inside the branch, so they are not software-pipelined by the compiler: programs are one warp and
small, many share an SM and hide each other's latency (as triton_decode_swap's grid does).
Grid, split ranges and epilogue as triton_hybrid's decode (store_decode, then _reduce_kernel).
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanokv.kernels.triton_dequant import int4_tile_f16, int8_tile_f16
from nanokv.kernels.triton_kvtile import split_range
from nanokv.kernels.triton_softmax import softmax_update_t, store_decode

# BIAS: codes are left as fp16 1152 + c (int8: byte spliced under 0x64 after the sign flip) and
# 1024 + c (nibbles), without the subtraction that triton_dequant's conversions end with (one packed
# instruction per two codes); the bias comes out through the zero terms, computed from the same fp16
# operands (q, and p * scale as rounded for the product): the difference is fp32 rounding of sums
# about 1000x the codes' (~1e-7 relative to scores and outputs).
_I8_BIASED = tl.constexpr("{ .reg .b32 t, z; mov.b32 z, 0x64646464; xor.b32 t, $2, 0x80808080; "
                          "prmt.b32 $0, t, z, 0x4140; prmt.b32 $1, t, z, 0x4342; }")
_I4_SPREAD = ("{ .reg .b32 x, y, z, m, o; mov.b32 z, 0; mov.b32 m, 0x000F000F; mov.b32 o, 0x64006400; "
              "prmt.b32 x, $2, z, 0x4140; prmt.b32 y, $2, z, 0x4342; ")
_I4_LO_BIASED = tl.constexpr(_I4_SPREAD + "lop3.b32 $0, x, m, o, 0xEA; lop3.b32 $1, y, m, o, 0xEA; }")
_I4_HI_BIASED = tl.constexpr(_I4_SPREAD + "shr.b32 x, x, 4; shr.b32 y, y, 4; lop3.b32 $0, x, m, o, 0xEA; "
                             "lop3.b32 $1, y, m, o, 0xEA; }")


@triton.jit
def _int8(c, CDT: tl.constexpr, ASM: tl.constexpr, BIAS: tl.constexpr):
    """int8 code tile -> CDT exactly (the PTX byte splice for fp16, triton_dequant), + BIAS."""
    if BIAS != 0:
        if ASM:
            return tl.inline_asm_elementwise(_I8_BIASED, "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return c.to(CDT) + BIAS
    elif CDT == tl.float16:
        return int8_tile_f16(c, ASM)
    else:
        return c.to(CDT)


@triton.jit
def _int4(c, CDT: tl.constexpr, ASM: tl.constexpr, BIAS: tl.constexpr):
    """uint8 tile of packed nibbles -> (low, high) in CDT exactly, + BIAS."""
    if BIAS != 0:
        if ASM:
            return (tl.inline_asm_elementwise(_I4_LO_BIASED, "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4),
                    tl.inline_asm_elementwise(_I4_HI_BIASED, "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4))
        else:
            return (c & 15).to(CDT) + BIAS, (c >> 4).to(CDT) + BIAS
    elif CDT == tl.float16:
        return int4_tile_f16(c, ASM)
    else:
        return (c & 15).to(CDT), (c >> 4).to(CDT)


@triton.jit
def _update(st, m_i, l_i, z_i, acc_lo, acc_hi):
    """Online softmax over one tile's scores st [BLOCK_N, BLOCK_G]: (p^T, m, l, z, acc) rescaled."""
    pt, alpha, m_i, l_i = softmax_update_t(st, m_i, l_i)
    return pt, m_i, l_i, z_i * alpha, acc_lo * alpha[None, :], acc_hi * alpha[None, :]


@triton.jit
def _pool_block(e, tin, valid, kvh, qt_lo, qt_hi, qk_scale, m_i, l_i, z_i, acc_lo, acc_hi,
                q_sum, kc, vc, c_n, c_h, c_s, ks, vs, s_n, s_h, s_s, offs_d,
                DH: tl.constexpr, BS: tl.constexpr, CDT: tl.constexpr, ASM: tl.constexpr, BIAS: tl.constexpr):
    """One tile of int8 pool block e (tokens tin [BLOCK_N] of it): keys token-major, values dims-major
    ([N, H, D, bs]: V^T rows are tokens, contiguous), both read as int8 tiles straight into the
    products (triton_decode_swap). Codes not masked (rows inside the block); invalid tokens get -inf."""
    base = e.to(tl.int64) * c_n + kvh * c_h
    srow = e.to(tl.int64) * s_n + kvh * s_h + tin * s_s
    kp = kc + base + tin[:, None] * c_s + offs_d[None, :]  # K [BLOCK_N, BLOCK_DH]
    vp = vc + base + offs_d[:, None] * BS + tin[None, :]  # V^T [BLOCK_DH, BLOCK_N]
    k_lo, k_hi = tl.load(kp), tl.load(kp + DH)
    v_lo, v_hi = tl.load(vp), tl.load(vp + DH * BS)
    k_s = tl.load(ks + srow).to(tl.float32) * qk_scale
    v_s = tl.load(vs + srow).to(tl.float32)
    st = tl.dot(_int8(k_hi, CDT, ASM, BIAS), qt_hi, tl.dot(_int8(k_lo, CDT, ASM, BIAS), qt_lo))  # [BLOCK_N, BLOCK_G]
    if BIAS != 0:
        st = st - BIAS * q_sum[None, :]
    st = tl.where(valid[:, None], st * k_s[:, None], float("-inf"))
    pt, m_i, l_i, z_i, acc_lo, acc_hi = _update(st, m_i, l_i, z_i, acc_lo, acc_hi)
    pv = (pt * v_s[:, None]).to(CDT)  # (p * scale)^T: range as in triton_kvtile.fold_v_weights
    acc_lo = tl.dot(_int8(v_lo, CDT, ASM, BIAS), pv, acc_lo)
    acc_hi = tl.dot(_int8(v_hi, CDT, ASM, BIAS), pv, acc_hi)
    if BIAS != 0:
        z_i = z_i - BIAS * tl.sum(pv.to(tl.float32), 0)
    return m_i, l_i, z_i, acc_lo, acc_hi


@triton.jit
def _slot_block(e, tin, valid, kvh, qt_lo, qt_hi, q_sum, qk_scale, m_i, l_i, z_i, acc_lo, acc_hi,
                kp, vp, p_n, p_h, p_s, ka, kz, va, vz, a_n, a_h, a_s, offs_d,
                CDT: tl.constexpr, ASM: tl.constexpr, BIAS: tl.constexpr):
    """One tile of INT4 store slot -2 - e: packed nibbles [bs, D/2] a (slot, head), token-major for
    keys and values (V^T is a transposing read), per-row scale and zero: x = code * scale + zero."""
    j = (-2 - e).to(tl.int64)
    base = j * p_n + kvh * p_h
    arow = j * a_n + kvh * a_h + tin * a_s
    kb = tl.load(kp + base + tin[:, None] * p_s + offs_d[None, :])  # [BLOCK_N, BLOCK_DH]
    vb = tl.load(vp + base + tin[None, :] * p_s + offs_d[:, None])  # [BLOCK_DH, BLOCK_N]
    k_s = tl.load(ka + arow).to(tl.float32) * qk_scale
    k_z = tl.load(kz + arow).to(tl.float32) * qk_scale
    v_s = tl.load(va + arow).to(tl.float32)
    v_z = tl.load(vz + arow).to(tl.float32)
    k_lo, k_hi = _int4(kb, CDT, ASM, BIAS)
    st = tl.dot(k_hi, qt_hi, tl.dot(k_lo, qt_lo))
    if BIAS != 0:
        k_z = k_z - BIAS * k_s
    st = tl.where(valid[:, None], st * k_s[:, None] + k_z[:, None] * q_sum[None, :], float("-inf"))
    pt, m_i, l_i, z_i, acc_lo, acc_hi = _update(st, m_i, l_i, z_i, acc_lo, acc_hi)
    v_lo, v_hi = _int4(vb, CDT, ASM, BIAS)
    pv = (pt * v_s[:, None]).to(CDT)
    acc_lo = tl.dot(v_lo, pv, acc_lo)
    acc_hi = tl.dot(v_hi, pv, acc_hi)
    z = tl.sum(pt * v_z[:, None], 0)
    if BIAS != 0:
        z = z - BIAS * tl.sum(pv.to(tl.float32), 0)
    return m_i, l_i, z_i + z, acc_lo, acc_hi


@triton.jit(do_not_specialize=["bt_ptr", "lens_ptr", "num_splits", "stride_bt"])
def block_decode_kernel(
    q_ptr, out_ptr, part_o_ptr, part_ml_ptr, bt_ptr, lens_ptr, qk_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    kc, vc, c_n, c_h, c_s, ks, vs, s_n, s_h, s_s, kp, vp, p_n, p_h, p_s, ka, kz, va, vz, a_n, a_h, a_s,
    D: tl.constexpr, DH: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, CDT: tl.constexpr, ASM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, BIAS: tl.constexpr,
):
    # arguments as triton_hybrid._decode_kernel's, codes as bytes (kc int8, kp/vp uint8); DH a power
    # of 2 >= 16 (no dim masks), BLOCK_N >= 16 dividing BS. BIAS (fp16 compute only): codes enter the
    # products biased (_int8, _int4), the bias taken out through the zero terms
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    _, lo, hi = split_range(lens_ptr, seq, split, num_splits, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, DH)
    offs_n = tl.arange(0, BLOCK_N)
    qt_rows = q_ptr + seq * stride_qt + (kvh * G + offs_g)[None, :] * stride_qh + offs_d[:, None]
    qm = (offs_g < G)[None, :] & (offs_d < DH)[:, None]
    qt_lo = tl.load(qt_rows, mask=qm, other=0.0).to(CDT)  # [DH, BLOCK_G]: q^T halves
    qt_hi = tl.load(qt_rows + DH, mask=qm, other=0.0).to(CDT)
    q_sum = tl.sum(qt_lo.to(tl.float32), 0) + tl.sum(qt_hi.to(tl.float32), 0)  # [BLOCK_G]: the store's key zeros
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    z_i = tl.zeros([BLOCK_G], tl.float32)  # sum of p * (value zero) over store tokens: on every dim
    acc_lo = tl.zeros([DH, BLOCK_G], tl.float32)  # o^T halves
    acc_hi = tl.zeros([DH, BLOCK_G], tl.float32)
    bt_row = bt_ptr + seq * stride_bt
    e_next = tl.load(bt_row + lo // BS, mask=lo < hi, other=-1)
    for start in range(lo, hi, BLOCK_N):  # whole tiles (split_range): start % BLOCK_N == 0
        e = e_next
        e_next = tl.load(bt_row + (start + BLOCK_N) // BS, mask=start + BLOCK_N < hi, other=-1)
        tin = tl.multiple_of(start % BS, BLOCK_N) + offs_n  # [BLOCK_N] token offsets in the block
        valid = start + offs_n < hi
        if e >= 0:
            m_i, l_i, z_i, acc_lo, acc_hi = _pool_block(
                e, tin, valid, kvh, qt_lo, qt_hi, qk_scale, m_i, l_i, z_i, acc_lo, acc_hi,
                q_sum, kc, vc, c_n, c_h, c_s, ks, vs, s_n, s_h, s_s, offs_d, DH, BS, CDT, ASM, BIAS * 1152.0)
        elif e <= -2:
            m_i, l_i, z_i, acc_lo, acc_hi = _slot_block(
                e, tin, valid, kvh, qt_lo, qt_hi, q_sum, qk_scale, m_i, l_i, z_i, acc_lo, acc_hi,
                kp, vp, p_n, p_h, p_s, ka, kz, va, vz, a_n, a_h, a_s, offs_d, CDT, ASM, BIAS * 1024.0)
    store_decode(tl.trans(acc_lo + z_i[None, :]), tl.trans(acc_hi + z_i[None, :]), m_i, l_i, offs_g, kvh, seq,
                 split, num_splits, out_ptr, part_o_ptr, part_ml_ptr, stride_ot, stride_oh, D, DH, G, DH, SPLIT)
