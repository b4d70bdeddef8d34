"""Paged prefill attention: variable-length causal attention whose K/V come from the paged cache.

The step's new K/V are stored first, so a prompt that partly hits the prefix cache, a later
chunk of a chunked prefill and a fresh prompt all read the same way: query token j of sequence i
(q_len_i of them, the LAST q_len_i positions of a context of seq_lens[i] tokens) sits at position
seq_lens[i] - q_len_i + j and sees keys 0..that position, minus holes.

Grid (query tiles, num_prefills, num_kv_heads). GQA-aware like decode: the BLOCK_M rows of a
program are (token, head) pairs of one KV head group, row r = token r // G, head r % G, so a
group's heads share every K/V tile. Programs past a sequence's last query tile do no work.

int4 (prefill_tile_kinds): a program walks its context in three runs of tiles compiled for what
they read, codes, both, staging (see the kernel), instead of looking every token up in both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton_dequant import use_asm, use_words
from nanokv.kernels.triton_kvtile import (
    code_args,
    compute_dtype,
    kv_meta_args,
    next_pow2,
    pv_accumulate,
    qk_scores,
    stage_args,
    stage_rows,
    tile_rows,
)
from nanokv.kernels.triton_softmax import online_softmax_step
from nanokv.kv.cache import LayerKV, check_layout

LOG2E = 1.4426950408889634


@triton.jit
def _attend(state, lo, hi, q_lo, q_hi, q_pos, bt_row, kv_end, kvh, ptrs, strides, qk_scale,
            D: tl.constexpr, DH: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, CDT: tl.constexpr,
            ASM: tl.constexpr, WORDS: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_N: tl.constexpr,
            STAGING: tl.constexpr):
    """The online softmax over the key tiles from lo (a tile start) to hi: state (m, l, acc_lo,
    acc_hi) -> state. STAGING: what the tiles read (triton_kvtile.qk_scores)."""
    m_i, l_i, acc_lo, acc_hi = state
    k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, kst_ptr, vst_ptr, stage_ptr = ptrs
    stride_kn, stride_kh, stride_ks, stride_sn, stride_sh, stride_cn, stride_ch, stride_stn, stride_sth = strides
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_DH)
    d_mask = offs_d < DH
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n
        valid, rows, phys = tile_rows(bt_row, tok, kv_end, kvh, stride_kn, stride_kh, stride_ks, BS)
        srows = phys * stride_sn + kvh * stride_sh + tok % BS
        crows, strows, staged = srows, srows, valid
        if BITS == 4:  # per-channel key scales; open blocks read from full-precision staging
            crows, strows, staged = stage_rows(stage_ptr, phys, valid, tok, kvh, stride_cn, stride_ch,
                                               stride_stn, stride_sth, BS, D, STAGING != 0)
        s = qk_scores(q_lo, q_hi, k_ptr, ks_ptr, kz_ptr, rows, srows, valid, offs_d, d_mask,
                      kst_ptr, crows, strows, staged, DH, BITS, ASM, WORDS, STAGING)
        keep = valid[None, :] & (tok[None, :] <= q_pos[:, None])
        s = tl.where(keep, s * qk_scale, float("-inf"))
        p, m_i, l_i, acc_lo, acc_hi = online_softmax_step(s, m_i, l_i, acc_lo, acc_hi)
        # int8 folds V scales into p (as the decode does): per-element scaling of the dims-major value
        # tiles cost 2,100 vs 1,400 loop instructions per 64 tokens (offline sm_90)
        acc_lo, acc_hi = pv_accumulate(p, acc_lo, acc_hi, v_ptr, vs_ptr, vz_ptr, rows, srows, valid, offs_d,
                                       d_mask, vst_ptr, strows, staged, bt_row, start, kv_end, kvh, stride_kn,
                                       stride_kh, DH, BITS, CDT, ASM, WORDS, BITS == 8, BS, STAGING)
    return m_i, l_i, acc_lo, acc_hi


# metadata pointers and sizes vary step to step (slices at the prefill count, table width): not
# specialized on, or each new alignment / divisibility class would compile the kernel again mid-run
@triton.jit(do_not_specialize=["bt_ptr", "seq_lens_ptr", "qsl_ptr", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, kst_ptr, vst_ptr, stage_ptr, bt_ptr, seq_lens_ptr,
    qsl_ptr, out_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kn, stride_kh, stride_ks, stride_sn, stride_sh, stride_bt,
    stride_cn, stride_ch, stride_stn, stride_sth,
    D: tl.constexpr, DH: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr,
    CDT: tl.constexpr, ASM: tl.constexpr, WORDS: tl.constexpr,
    BLOCK_M: tl.constexpr, TOKENS: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_N: tl.constexpr,
    KINDS: tl.constexpr,
):
    # TOKENS = BLOCK_M // G query tokens per tile (rows beyond TOKENS * G idle)
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first = tile * TOKENS  # first query token (local index) of this tile
    n_tok = tl.maximum(tl.minimum(q_len - first, TOKENS), 0)  # 0 for programs past the end

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DH)
    t_local = first + offs_m // G
    heads = kvh * G + offs_m % G
    row_ok = offs_m < n_tok * G
    d_mask = offs_d < DH
    q_pos = seq_len - q_len + t_local  # [BLOCK_M] true positions of the query tokens
    qm = row_ok[:, None] & d_mask[None, :]
    q_rows = q_ptr + (q_start + t_local)[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_lo = tl.load(q_rows + offs_d[None, :], mask=qm, other=0.0).to(CDT)  # [BLOCK_M, BLOCK_DH]
    q_hi = tl.load(q_rows + DH + offs_d[None, :], mask=qm, other=0.0).to(CDT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, BLOCK_DH], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, BLOCK_DH], tl.float32)
    # keys up to the last query token of this tile (causal); 0 when the tile is empty
    kv_end = tl.where(n_tok > 0, seq_len - q_len + first + n_tok, 0)
    bt_row = bt_ptr + seq * stride_bt
    # int4 with KINDS: the context in three runs of tiles, each compiled for what it reads. Blocks
    # wholly before the step's first token were filled by earlier steps, so they hold codes; every
    # block this step writes is staged (StageTable.plan). cb = first token of the first staged block:
    # tiles before a read codes only, the one tile [a, b) holding cb both, tiles from b staging only.
    cb = (seq_len - q_len) // BS * BS
    a = tl.minimum(cb // BLOCK_N * BLOCK_N, kv_end)
    b = tl.minimum(tl.cdiv(cb, BLOCK_N) * BLOCK_N, kv_end)
    state = (m_i, l_i, acc_lo, acc_hi)
    ptrs = (k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, kst_ptr, vst_ptr, stage_ptr)
    strides = (stride_kn, stride_kh, stride_ks, stride_sn, stride_sh, stride_cn, stride_ch, stride_stn, stride_sth)
    if BITS == 4 and KINDS:
        state = _attend(state, 0, a, q_lo, q_hi, q_pos, bt_row, kv_end, kvh, ptrs, strides, qk_scale,
                        D, DH, BS, BITS, CDT, ASM, WORDS, BLOCK_DH, BLOCK_N, 0)
        state = _attend(state, a, b, q_lo, q_hi, q_pos, bt_row, kv_end, kvh, ptrs, strides, qk_scale,
                        D, DH, BS, BITS, CDT, ASM, WORDS, BLOCK_DH, BLOCK_N, 2)
        state = _attend(state, b, kv_end, q_lo, q_hi, q_pos, bt_row, kv_end, kvh, ptrs, strides, qk_scale,
                        D, DH, BS, BITS, CDT, ASM, WORDS, BLOCK_DH, BLOCK_N, 1)
    else:
        state = _attend(state, 0, kv_end, q_lo, q_hi, q_pos, bt_row, kv_end, kvh, ptrs, strides, qk_scale,
                        D, DH, BS, BITS, CDT, ASM, WORDS, BLOCK_DH, BLOCK_N, 2)
    m_i, l_i, acc_lo, acc_hi = state

    inv_l = 1.0 / tl.where(l_i > 0, l_i, 1.0)  # acc is 0 where l is
    o_rows = out_ptr + (q_start + t_local)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh
    tl.store(o_rows + offs_d[None, :], (acc_lo * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=qm)
    tl.store(o_rows + DH + offs_d[None, :], (acc_hi * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=qm)


def paged_prefill(q: torch.Tensor, cache: LayerKV, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, max_query_len: int, out: torch.Tensor, scale: float,
                  block_m: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                  asm: bool | None = None, words: bool | None = None, tile_kinds: bool = True) -> torch.Tensor:
    """q: [Tp, Hq, D] prefill tokens, packed; block_tables: [P, max_blocks] int32 (-1 holes);
    seq_lens: [P] int32; query_start_loc: [P + 1] int32 (starts at 0); out: [Tp, Hq, D] in place.
    tile_kinds (int4): the context read in runs of tiles by position, which relies on how the runner
    stages (StageTable.plan, quantize-on-fill after attention): blocks wholly before a sequence's first
    query token hold codes, every block holding one of its query tokens is staged. Off: every token
    is looked up in the staging map (any state)."""
    P = int(seq_lens.shape[0])
    Tp, Hq, D = q.shape
    H = cache.num_kv_heads
    if P == 0 or Tp == 0:
        return out
    assert Hq % H == 0 and D % 2 == 0 and q.stride(-1) == 1 and out.stride(-1) == 1
    G = Hq // H
    block_m = max(block_m, next_pow2(G), 16)  # at least one token per tile
    tokens = block_m // G
    check_layout(cache)
    ks, vs, kz, vz = kv_meta_args(cache)
    kst, vst, stage_of, *strides = stage_args(cache)
    cdt = compute_dtype(q.dtype, cache.bits)
    words = use_words(cache.quantized, cdt, D) if words is None else words
    k, v = code_args(cache, words)
    grid = (triton.cdiv(max_query_len, tokens), P, H)
    _prefill_kernel[grid](
        q, k, v, ks, vs, kz, vz, kst, vst, stage_of, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.k.stride(0), cache.k.stride(1), cache.k.stride(2),
        vs.stride(0) if cache.quantized else 0, vs.stride(1) if cache.quantized else 0,
        block_tables.stride(0), *strides,
        D=D, DH=D // 2, G=G, BS=cache.block_size, CDT=cdt, ASM=use_asm(q.device) if asm is None else asm,
        WORDS=words,
        BITS=cache.bits if cache.quantized else 16,
        BLOCK_M=block_m, TOKENS=tokens, BLOCK_DH=max(16, next_pow2(D // 2)), BLOCK_N=block_n, KINDS=tile_kinds,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
