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
hybrid_decode(per_block=True) runs triton_hybrid_block's kernel instead (same grid and merge): tiles
inside one block, one branch per tile on its entry, so each block is read and converted only as what it
is and holes cost no loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton_decode import _buffer, _reduce_kernel
from nanokv.kernels.triton_dequant import use_asm, use_words
from nanokv.kernels.triton_hybrid_block import block_decode_kernel
from nanokv.kernels.triton_hybrid_tile import (
    check,
    key_scores,
    tile_args,
    tile_entries,
    tile_rows,
    value_accumulate,
)
from nanokv.kernels.triton_kvtile import compute_dtype, next_pow2, split_range
from nanokv.kernels.triton_softmax import decode_softmax_step, store_decode
from nanokv.kv.demote import HybridInt8KV

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["bt_ptr", "lens_ptr", "num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr, out_ptr, part_o_ptr, part_ml_ptr, bt_ptr, lens_ptr, qk_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    kc, vc, c_n, c_h, c_s, ks, vs, s_n, s_h, s_s, kp, vp, p_n, p_h, p_s, ka, kz, va, vz, a_n, a_h, a_s,
    D: tl.constexpr, DH: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, CDT: tl.constexpr, WORDS: tl.constexpr,
    ASM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    _, lo, hi = split_range(lens_ptr, seq, split, num_splits, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_DH)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < DH
    qm = (offs_g < G)[:, None] & d_mask[None, :]
    q_rows = q_ptr + seq * stride_qt + (kvh * G + offs_g)[:, None] * stride_qh + offs_d[None, :]
    q_lo = tl.load(q_rows, mask=qm, other=0.0).to(CDT)  # [BLOCK_G, BLOCK_DH]
    q_hi = tl.load(q_rows + DH, mask=qm, other=0.0).to(CDT)
    q_sum = tl.sum(q_lo.to(tl.float32), 1) + tl.sum(q_hi.to(tl.float32), 1)  # [BLOCK_G]: the store's key zeros
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    z_i = tl.zeros([BLOCK_G], tl.float32)  # sum of p * (value zero) over the store's tokens, on every dim
    acc_lo = tl.zeros([BLOCK_G, BLOCK_DH], tl.float32)
    acc_hi = tl.zeros([BLOCK_G, BLOCK_DH], tl.float32)
    bt_row = bt_ptr + seq * stride_bt
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n
        entry, valid = tile_entries(bt_row, tok, hi, BS)
        pool, slot, crow, srow, prow, arow = tile_rows(entry, valid, tok, kvh, c_n, c_h, c_s, s_n, s_h, s_s,
                                                       p_n, p_h, p_s, a_n, a_h, a_s, BS)
        s = key_scores(q_lo, q_hi, q_sum, valid, pool, slot, crow, srow, prow, arow, offs_d, d_mask, qk_scale,
                       kc, ks, kp, ka, kz, DH, WORDS, ASM)
        p, alpha, m_i, l_i, acc_lo, acc_hi = decode_softmax_step(s, m_i, l_i, acc_lo, acc_hi, 0)
        acc_lo, acc_hi, z = value_accumulate(p, acc_lo, acc_hi, pool, slot, srow, prow, arow, start, hi, bt_row, kvh,
                                             offs_d, d_mask, vc, c_n, c_h, vs, vp, va, vz, BS, DH, CDT, WORDS, ASM)
        z_i = z_i * alpha + z
    store_decode(acc_lo + z_i[:, None], acc_hi + z_i[:, None], m_i, l_i, offs_g, kvh, seq, split, num_splits,
                 out_ptr, part_o_ptr, part_ml_ptr, stride_ot, stride_oh, D, DH, G, BLOCK_DH, SPLIT)


@triton.jit(do_not_specialize=["bt_ptr", "lens_ptr", "qsl_ptr", "stride_bt"])
def _prefill_kernel(
    q_ptr, out_ptr, bt_ptr, lens_ptr, qsl_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    kc, vc, c_n, c_h, c_s, ks, vs, s_n, s_h, s_s, kp, vp, p_n, p_h, p_s, ka, kz, va, vz, a_n, a_h, a_s,
    DH: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, CDT: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr,
    BLOCK_M: tl.constexpr, TOKENS: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_N: tl.constexpr,
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
    q_sum = tl.sum(q_lo.to(tl.float32), 1) + tl.sum(q_hi.to(tl.float32), 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    z_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, BLOCK_DH], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, BLOCK_DH], tl.float32)
    # keys up to this tile's last query (causal); none for a tile past the sequence's queries
    hi = tl.where(mt * TOKENS < q_len, tl.minimum(seq_len, seq_len - q_len + (mt + 1) * TOKENS), 0)
    bt_row = bt_ptr + seq * stride_bt
    for start in range(0, hi, BLOCK_N):
        tok = start + offs_n
        entry, valid = tile_entries(bt_row, tok, hi, BS)
        pool, slot, crow, srow, prow, arow = tile_rows(entry, valid, tok, kvh, c_n, c_h, c_s, s_n, s_h, s_s,
                                                       p_n, p_h, p_s, a_n, a_h, a_s, BS)
        s = key_scores(q_lo, q_hi, q_sum, valid, pool, slot, crow, srow, prow, arow, offs_d, d_mask, qk_scale,
                       kc, ks, kp, ka, kz, DH, WORDS, ASM)  # [BLOCK_M, BLOCK_N]
        s = tl.where((tok[None, :] <= qpos[:, None]) & r_mask[:, None], s, float("-inf"))
        p, alpha, m_i, l_i, acc_lo, acc_hi = decode_softmax_step(s, m_i, l_i, acc_lo, acc_hi, 0)
        acc_lo, acc_hi, z = value_accumulate(p, acc_lo, acc_hi, pool, slot, srow, prow, arow, start, hi, bt_row, kvh,
                                             offs_d, d_mask, vc, c_n, c_h, vs, vp, va, vz, BS, DH, CDT, WORDS, ASM)
        z_i = z_i * alpha + z
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)  # (no key seen: l = 0 and a zero accumulator)
    po = out_ptr + (q0 + t)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(po, ((acc_lo + z_i[:, None]) * inv[:, None]).to(out_ptr.dtype.element_ty), mask=qm)
    tl.store(po + DH, ((acc_hi + z_i[:, None]) * inv[:, None]).to(out_ptr.dtype.element_ty), mask=qm)


def hybrid_decode(q: torch.Tensor, cache: HybridInt8KV, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  out: torch.Tensor, scale: float, num_splits: int = 1, block_n: int = 64, num_warps: int = 4,
                  num_stages: int = 2, per_block: bool = False, block_tile: int = 16, block_warps: int = 1,
                  block_maxnreg: int = 0, block_bias: bool = False) -> torch.Tensor:
    """q: [B, Hq, D] one token per sequence; block_tables: [B, max_blocks] int32 mixed (see the tile
    module); seq_lens: [B] int32 (context incl. this token); out: [B, Hq, D], written in place.
    block_n: tokens per tile, a power of 2 >= 16 (tiles may span blocks or part of one).
    per_block: the block kernel instead (triton_hybrid_block: one branch per block on its entry, holes
    skipped), with tiles of block_tile tokens (>= 16, dividing the block size), block_warps warps a
    program and block_maxnreg registers a thread at most (0: no cap); block_n and num_warps unused.
    block_bias: its codes enter the products biased, the bias folded into the zero terms (fp16 compute)."""
    B = q.shape[0]
    if B == 0:
        return out
    Hq, D, G = check(q, cache, out)
    if per_block:
        return _block_decode(q, cache, block_tables, seq_lens, out, scale, num_splits, block_tile, block_warps,
                             num_stages, block_maxnreg, block_bias)
    part_o, part_ml = _partials(q, out, num_splits)
    consts = _consts(q, cache, D)
    _decode_kernel[(B, cache.num_kv_heads, num_splits)](
        q, out, part_o, part_ml, block_tables, seq_lens, scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *tile_args(cache, consts["WORDS"]), D=D, BLOCK_G=max(16, next_pow2(G)), BLOCK_N=block_n,
        SPLIT=num_splits > 1, num_warps=num_warps, num_stages=num_stages, **consts)
    return _merge(part_o, part_ml, out, num_splits)


def _block_decode(q: torch.Tensor, cache: HybridInt8KV, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  out: torch.Tensor, scale: float, num_splits: int, tile: int, warps: int, stages: int,
                  maxnreg: int, bias: bool) -> torch.Tensor:
    """hybrid_decode(per_block=True): triton_hybrid_block's kernel, codes read as bytes."""
    B, _, D = q.shape
    bs = cache.block_size
    if tile < 16 or tile & (tile - 1) or bs % tile:
        raise ValueError(f"hybrid_decode: block_tile {tile} must be a power of 2 >= 16 dividing the block size {bs}")
    if D // 2 < 16 or (D // 2) & (D // 2 - 1):
        raise ValueError(f"hybrid_decode: per_block needs head_dim / 2 a power of 2 >= 16, got head_dim {D}")
    part_o, part_ml = _partials(q, out, num_splits)
    c = _consts(q, cache, D)
    block_decode_kernel[(B, cache.num_kv_heads, num_splits)](
        q, out, part_o, part_ml, block_tables, seq_lens, scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *tile_args(cache, False), D=D, DH=c["DH"], G=c["G"], BS=bs, CDT=c["CDT"], ASM=c["ASM"],
        BLOCK_G=next_pow2(c["G"]), BLOCK_N=tile, BIAS=bias and c["CDT"] == tl.float16,
        SPLIT=num_splits > 1, num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg > 0 else {}))
    return _merge(part_o, part_ml, out, num_splits)


def _partials(q: torch.Tensor, out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(part_o, part_ml): the split-K scratch, the decode path's cached buffer (no allocation after
    warm-up: CUDA graphs); `out` twice (unused) for one split."""
    if num_splits <= 1:
        return out, out
    B, Hq, D = q.shape
    buf = _buffer("hybrid_partials", q.device, B * Hq * num_splits * (D + 2), torch.float32)
    return buf[:B * Hq * num_splits * D], buf[B * Hq * num_splits * D:]


def _merge(part_o: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor, num_splits: int) -> torch.Tensor:
    """Several splits: triton_decode's merge (store_decode wrote the partials in its layout)."""
    if num_splits > 1:
        B, Hq, D = out.shape
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
    consts = _consts(q, cache, D)
    _prefill_kernel[(triton.cdiv(max_query_len, tokens), P, cache.num_kv_heads)](
        q, out, block_tables, seq_lens, query_start_loc, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *tile_args(cache, consts["WORDS"]), BLOCK_M=block_m, TOKENS=tokens, BLOCK_N=block_n, num_warps=num_warps,
        num_stages=num_stages, **consts)
    return out


def _consts(q: torch.Tensor, cache: HybridInt8KV, D: int) -> dict:
    """The constexprs both kernels share: fp16 compute for fp16 and bf16 queries (as the int8 kernels,
    triton_kvtile.compute_dtype), token-major codes read as words where the head dim allows."""
    cdt = compute_dtype(q.dtype, 8)
    return dict(DH=D // 2, G=q.shape[1] // cache.num_kv_heads, BS=cache.block_size, CDT=cdt,
                WORDS=use_words(True, cdt, D), ASM=use_asm(q.device), BLOCK_DH=max(16, next_pow2(D // 2)))
