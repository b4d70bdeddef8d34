"""Paged decode and prefill attention for int8 layers under hybrid sparsity (Triton; CPU under TRITON_INTERPRET=1).

One block table mixes int8 pool blocks, INT4 demotion-store slots and holes (encoding and tile read:
nanokv.kernels.triton_hybrid_tile). Both kernels take the step's table as it is: one launch per
call whatever the mix, shapes fixed by host-known sizes, no host sync, so a decode step captures in
a CUDA graph (its split-K scratch is the decode path's cached buffer: nothing allocated after warm-up).

decode: grid (num_decodes, num_kv_heads, num_splits); a program owns a KV head's G query rows (padded
to 16 for the tensor-core products) and a contiguous share of the sequence's tiles, derived on the
device from seq_len; with several splits `_reduce_kernel` merges the normalized partials by their
(max, sum). prefill: grid (query tiles, num_prefills, num_kv_heads); rows of a tile are (token, head)
pairs of one KV head group (row r = token r // G, head r % G) so a group shares every K/V tile;
query token t of a sequence sits at position seq_len - q_len + t and sees keys up to it, minus holes.
A row that sees no key at all (every block of its context a hole) gets a zero output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton_decode import _buffer
from nanokv.kernels.triton_hybrid_tile import check, hybrid_tile, online_step, tile_args, tile_entries
from nanokv.kernels.triton_kvtile import compute_dtype, next_pow2
from nanokv.kv.demote import HybridInt8KV

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["bt_ptr", "lens_ptr", "num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr, out_ptr, part_o_ptr, part_ml_ptr, bt_ptr, lens_ptr, qk_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    kc, kc_n, kc_h, kc_s, kc_d, ks, ks_n, ks_h, ks_s, kp, kp_n, kp_h, kp_s, ka, kz, ka_n, ka_h, ka_s,
    vc, vc_n, vc_h, vc_s, vc_d, vs, vs_n, vs_h, vs_s, vp, vp_n, vp_h, vp_s, va, vz, va_n, va_h, va_s,
    DH: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, CDT: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_DH: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    per = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)  # tiles per split
    lo = split * per * BLOCK_N
    hi = tl.minimum(lo + per * BLOCK_N, seq_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_DH)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < DH
    heads = kvh * G + offs_g
    qm = g_mask[:, None] & d_mask[None, :]
    q_rows = q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q_lo = tl.load(q_rows, mask=qm, other=0.0).to(CDT)  # [BLOCK_G, BLOCK_DH]
    q_hi = tl.load(q_rows + DH, mask=qm, other=0.0).to(CDT)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_lo = tl.zeros([BLOCK_G, BLOCK_DH], tl.float32)
    acc_hi = tl.zeros([BLOCK_G, BLOCK_DH], tl.float32)
    bt_row = bt_ptr + seq * stride_bt
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n
        entry, valid = tile_entries(bt_row, tok, hi, BS)
        k_lo, k_hi = hybrid_tile(entry, valid, tok, kvh, offs_d, d_mask, kc, kc_n, kc_h, kc_s, kc_d,
                                 ks, ks_n, ks_h, ks_s, kp, kp_n, kp_h, kp_s, ka, kz, ka_n, ka_h, ka_s, BS, DH)
        s = tl.dot(q_lo, tl.trans(k_lo.to(CDT))) + tl.dot(q_hi, tl.trans(k_hi.to(CDT)))  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        v_lo, v_hi = hybrid_tile(entry, valid, tok, kvh, offs_d, d_mask, vc, vc_n, vc_h, vc_s, vc_d,
                                 vs, vs_n, vs_h, vs_s, vp, vp_n, vp_h, vp_s, va, vz, va_n, va_h, va_s, BS, DH)
        m_i, l_i, acc_lo, acc_hi = online_step(s, m_i, l_i, acc_lo, acc_hi, v_lo, v_hi, CDT)
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)  # (no key seen: l = 0 and a zero accumulator)
    o_lo = acc_lo * inv[:, None]
    o_hi = acc_hi * inv[:, None]
    if SPLIT:  # partial [B, Hq, S, D] normalized, (max, sum) [B, Hq, S, 2]
        row = (seq * (tl.num_programs(1) * G) + heads) * num_splits + split
        po = part_o_ptr + row[:, None] * (2 * DH) + offs_d[None, :]
        tl.store(po, o_lo, mask=qm)
        tl.store(po + DH, o_hi, mask=qm)
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)
    else:
        po = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(po, o_lo.to(out_ptr.dtype.element_ty), mask=qm)
        tl.store(po + DH, o_hi.to(out_ptr.dtype.element_ty), mask=qm)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(part_o_ptr, part_ml_ptr, out_ptr, num_splits, stride_ot, stride_oh,
                   D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (num_decodes, Hq): out = the splits' partials weighted by 2^(m - max) * l; zero if no split saw a key."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    row = (seq * tl.num_programs(1) + h) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    m = tl.load(part_ml_ptr + (row + offs_s) * 2, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + (row + offs_s) * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max)) * l_s  # [BLOCK_S]; 0 for empty splits
    total = tl.sum(w, 0)
    o = tl.load(part_o_ptr + (row + offs_s)[:, None] * D + offs_d[None, :],
                mask=s_mask[:, None] & (offs_d[None, :] < D), other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=offs_d < D)


@triton.jit(do_not_specialize=["bt_ptr", "lens_ptr", "qsl_ptr", "stride_bt"])
def _prefill_kernel(
    q_ptr, out_ptr, bt_ptr, lens_ptr, qsl_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    kc, kc_n, kc_h, kc_s, kc_d, ks, ks_n, ks_h, ks_s, kp, kp_n, kp_h, kp_s, ka, kz, ka_n, ka_h, ka_s,
    vc, vc_n, vc_h, vc_s, vc_d, vs, vs_n, vs_h, vs_s, vp, vp_n, vp_h, vp_s, va, vz, va_n, va_h, va_s,
    DH: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, CDT: tl.constexpr, BLOCK_M: tl.constexpr,
    TOKENS: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_N: tl.constexpr,
):
    mt = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q0 = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q0
    seq_len = tl.load(lens_ptr + seq)
    offs_r = tl.arange(0, BLOCK_M)
    t = mt * TOKENS + offs_r // G  # query token of each row, within the sequence's step
    heads = kvh * G + offs_r % G
    r_mask = (offs_r < TOKENS * G) & (t < q_len)
    qpos = seq_len - q_len + t  # [BLOCK_M] positions
    offs_d = tl.arange(0, BLOCK_DH)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < DH
    qm = r_mask[:, None] & d_mask[None, :]
    q_rows = q_ptr + (q0 + t)[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q_lo = tl.load(q_rows, mask=qm, other=0.0).to(CDT)
    q_hi = tl.load(q_rows + DH, mask=qm, other=0.0).to(CDT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, BLOCK_DH], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, BLOCK_DH], tl.float32)
    # keys up to this tile's last query (causal); none for a tile past the sequence's queries
    hi = tl.where(mt * TOKENS < q_len, tl.minimum(seq_len, seq_len - q_len + (mt + 1) * TOKENS), 0)
    bt_row = bt_ptr + seq * stride_bt
    for start in range(0, hi, BLOCK_N):
        tok = start + offs_n
        entry, valid = tile_entries(bt_row, tok, hi, BS)
        k_lo, k_hi = hybrid_tile(entry, valid, tok, kvh, offs_d, d_mask, kc, kc_n, kc_h, kc_s, kc_d,
                                 ks, ks_n, ks_h, ks_s, kp, kp_n, kp_h, kp_s, ka, kz, ka_n, ka_h, ka_s, BS, DH)
        s = tl.dot(q_lo, tl.trans(k_lo.to(CDT))) + tl.dot(q_hi, tl.trans(k_hi.to(CDT)))  # [BLOCK_M, BLOCK_N]
        ok = valid[None, :] & (tok[None, :] <= qpos[:, None]) & r_mask[:, None]
        s = tl.where(ok, s * qk_scale, float("-inf"))
        v_lo, v_hi = hybrid_tile(entry, valid, tok, kvh, offs_d, d_mask, vc, vc_n, vc_h, vc_s, vc_d,
                                 vs, vs_n, vs_h, vs_s, vp, vp_n, vp_h, vp_s, va, vz, va_n, va_h, va_s, BS, DH)
        m_i, l_i, acc_lo, acc_hi = online_step(s, m_i, l_i, acc_lo, acc_hi, v_lo, v_hi, CDT)
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)  # (no key seen: l = 0 and a zero accumulator)
    po = out_ptr + (q0 + t)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(po, (acc_lo * inv[:, None]).to(out_ptr.dtype.element_ty), mask=qm)
    tl.store(po + DH, (acc_hi * inv[:, None]).to(out_ptr.dtype.element_ty), mask=qm)


def hybrid_decode(q: torch.Tensor, cache: HybridInt8KV, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  out: torch.Tensor, scale: float, num_splits: int = 1, block_n: int = 64, num_warps: int = 4,
                  num_stages: int = 2) -> torch.Tensor:
    """q: [B, Hq, D] one token per sequence; block_tables: [B, max_blocks] int32 mixed (see the tile
    module); seq_lens: [B] int32 (context incl. this token); out: [B, Hq, D], written in place."""
    B = q.shape[0]
    if B == 0:
        return out
    Hq, D, G = check(q, cache, out)
    split = num_splits > 1
    if split:  # the decode path's cached scratch: no allocation after warm-up (CUDA graphs)
        buf = _buffer("hybrid_partials", q.device, B * Hq * num_splits * (D + 2), torch.float32)
        part_o, part_ml = buf[:B * Hq * num_splits * D], buf[B * Hq * num_splits * D:]
    else:
        part_o = part_ml = out  # unused
    _decode_kernel[(B, cache.num_kv_heads, num_splits)](
        q, out, part_o, part_ml, block_tables, seq_lens, scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), *tile_args(cache),
        DH=D // 2, G=G, BS=cache.block_size, CDT=compute_dtype(q.dtype, 8), BLOCK_G=max(16, next_pow2(G)),
        BLOCK_DH=max(16, next_pow2(D // 2)), BLOCK_N=block_n, SPLIT=split, num_warps=num_warps,
        num_stages=num_stages)
    if split:
        _reduce_kernel[(B, Hq)](part_o, part_ml, out, num_splits, out.stride(0), out.stride(1),
                                D=D, BLOCK_S=next_pow2(num_splits), BLOCK_D=next_pow2(D), num_warps=4)
    return out


def hybrid_prefill(q: torch.Tensor, cache: HybridInt8KV, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, max_query_len: int, out: torch.Tensor, scale: float,
                   block_m: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """q: [T, Hq, D] (rows query_start_loc[0] .. query_start_loc[P] are these prefills' tokens, packed);
    block_tables: [P, max_blocks] int32 mixed; seq_lens: [P] int32; query_start_loc: [P + 1] int32;
    out: [T, Hq, D] written in place at the same rows."""
    P = int(seq_lens.shape[0])
    if P == 0 or max_query_len == 0:
        return out
    Hq, D, G = check(q, cache, out)
    block_m = max(block_m, next_pow2(G), 16)
    tokens = block_m // G
    _prefill_kernel[(triton.cdiv(max_query_len, tokens), P, cache.num_kv_heads)](
        q, out, block_tables, seq_lens, query_start_loc, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), *tile_args(cache),
        DH=D // 2, G=G, BS=cache.block_size, CDT=compute_dtype(q.dtype, 8), BLOCK_M=block_m, TOKENS=tokens,
        BLOCK_DH=max(16, next_pow2(D // 2)), BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
    return out
