"""Paged decode attention (one query token per sequence), GQA-aware, split-K flash-decoding.

Grid (num_decodes, num_kv_heads, num_splits). One program owns every query head of one KV head
group, so each K/V tile is read from memory once for the whole group: the group's G query rows
are padded to BLOCK_G >= 16 rows so the two small products run on the tensor cores.

Split-K: a sequence's tiles are divided among `num_splits` programs *inside* the kernel (from its
seq_len), so the grid depends only on host-known sizes: no host syncs, CUDA-graph safe. With
num_splits > 1 each program writes a normalized partial output plus its (max, sum) in base 2, and
`_reduce_kernel` merges them.

int4 caches go to triton_decode_int4 (key scales folded into the query, row groups) unless
fold_k is off; this file's kernel serves 16-bit and int8 caches and the generic int4 path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.kernels import cuda_decode_int4
from nanokv.kernels.triton_decode_int4 import decode_int4_kernel, int4_tiles
from nanokv.kernels.triton_decode_swap import decode_int8_swap_kernel, runs_transposed
from nanokv.kernels.triton_decode_swap4 import decode_int4_swap_kernel
from nanokv.kernels.triton_dequant import use_asm, use_words
from nanokv.kernels.triton_kvtile import (
    code_args,
    compute_dtype,
    kv_meta_args,
    next_pow2,
    pv_accumulate,
    qk_scores,
    split_range,
    stage_args,
    stage_rows,
    tile_rows,
)
from nanokv.kernels.triton_softmax import decode_softmax_step, merge_splits, store_decode
from nanokv.kv.cache import Int4KV, LayerKV, check_layout

LOG2E = 1.4426950408889634


# metadata pointers and sizes vary step to step (slices at the prefill count, table width): not
# specialized on, or each new alignment / divisibility class would compile the kernel again mid-run
@triton.jit(do_not_specialize=["bt_ptr", "seq_lens_ptr", "num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, kst_ptr, vst_ptr, stage_ptr, bt_ptr, seq_lens_ptr,
    out_ptr, part_o_ptr, part_ml_ptr,
    qk_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kn, stride_kh, stride_ks, stride_sn, stride_sh, stride_bt,
    stride_cn, stride_ch, stride_stn, stride_sth,
    D: tl.constexpr, DH: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr,
    CDT: tl.constexpr, ASM: tl.constexpr, WORDS: tl.constexpr, FOLD_V: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    LAZY_TAU: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    _, lo, hi = split_range(seq_lens_ptr, seq, split, num_splits, BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_DH)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < DH
    heads = kvh * G + offs_g
    q_rows = q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    qm = g_mask[:, None] & d_mask[None, :]
    q_lo = tl.load(q_rows, mask=qm, other=0.0).to(CDT)  # [BLOCK_G, BLOCK_DH]
    q_hi = tl.load(q_rows + DH, mask=qm, other=0.0).to(CDT)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_lo = tl.zeros([BLOCK_G, BLOCK_DH], tl.float32)
    acc_hi = tl.zeros([BLOCK_G, BLOCK_DH], tl.float32)
    bt_row = bt_ptr + seq * stride_bt
    for start in range(lo, hi, BLOCK_N):
        tok = start + offs_n
        valid, rows, phys = tile_rows(bt_row, tok, hi, kvh, stride_kn, stride_kh, stride_ks, BS)
        srows = phys * stride_sn + kvh * stride_sh + tok % BS
        crows, strows, staged = srows, srows, valid
        if BITS == 4:  # per-channel key scales; open blocks read from full-precision staging
            crows, strows, staged = stage_rows(stage_ptr, phys, valid, tok, kvh, stride_cn, stride_ch,
                                               stride_stn, stride_sth, BS, D)
        s = qk_scores(q_lo, q_hi, k_ptr, ks_ptr, kz_ptr, rows, srows, valid, offs_d, d_mask,
                      kst_ptr, crows, strows, staged, DH, BITS, ASM, WORDS, 2)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        p, _alpha, m_i, l_i, acc_lo, acc_hi = decode_softmax_step(s, m_i, l_i, acc_lo, acc_hi, LAZY_TAU)
        acc_lo, acc_hi = pv_accumulate(p, acc_lo, acc_hi, v_ptr, vs_ptr, vz_ptr, rows, srows, valid, offs_d,
                                       d_mask, vst_ptr, strows, staged, bt_row, start, hi, kvh, stride_kn,
                                       stride_kh, DH, BITS, CDT, ASM, WORDS, FOLD_V, BS, 2)

    store_decode(acc_lo, acc_hi, m_i, l_i, offs_g, kvh, seq, split, num_splits, out_ptr, part_o_ptr, part_ml_ptr,
                 stride_ot, stride_oh, D, DH, G, BLOCK_DH, SPLIT)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(part_o_ptr, part_ml_ptr, out_ptr, num_splits, stride_ot, stride_oh,
                   D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (num_decodes, Hq): merge the splits' partial outputs with their softmax weights."""
    merge_splits(part_o_ptr, part_ml_ptr, out_ptr, tl.program_id(0), tl.program_id(1), tl.num_programs(1),
                 num_splits, stride_ot, stride_oh, D, BLOCK_S, BLOCK_D, "")


_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def _buffer(kind: str, device: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A cached buffer per (kind, device), zero when made: "partials" (fp32, the splits' outputs) and
    "counts" (int32, the in-kernel merge's arrival counters, which must be zero between launches;
    merge_if_last resets its own). After the first (warm-up) step nothing is allocated here, so the
    decode path stays capturable in a CUDA graph; an outgrown buffer is kept alive, since a graph
    captured earlier still points at it."""
    buf = _BUFFERS.get((kind, device))
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(numel, 1 << 16), dtype=dtype, device=device)
        _BUFFERS[(kind, device)] = buf
    return buf[:numel]


def paged_decode(q: torch.Tensor, cache: LayerKV, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 out: torch.Tensor, scale: float, num_splits: int = 1, block_n: int = 64,
                 num_warps: int = 4, num_stages: int = 2, asm: bool | None = None,
                 words: bool | None = None, fold_k: bool = True, fold_v: bool = True,
                 maxnreg: int = 0, lazy_tau: int = 0, min_rows: int = 16, swap_block_n: int = 0,
                 swap_maxnreg: int = 0, swap_stages: int = 0, swap_merge: bool = True,
                 swap4: bool = False, swap4_prefetch: int = 0, swap4_maxnreg: int = 0, cuda4: bool = False,
                 cuda4_maxnreg: int = 0, cuda4_stages: int = 2, fill_slots: torch.Tensor | None = None,
                 seq_order: torch.Tensor | None = None, cuda4_tiles: int = 1, cuda4_direct: bool = True
                 ) -> bool:
    """q: [B, Hq, D] (one token per sequence); block_tables: [B, max_blocks] int32 (-1 holes);
    seq_lens: [B] int32 (context incl. this token); out: [B, Hq, D], written in place.
    fold_k: int4 keys' per-block channel scales folded into the query (triton_decode_int4), else
    the generic kernel dequantizes each key tile. fold_v: int8/int4 V scales folded into the softmax
    weights (int4 only together with fold_k). maxnreg > 0 caps registers per thread (ptxas
    .maxnreg), e.g. 168 lets 3 programs of 4 warps share an SM. lazy_tau > 0: accumulators are
    rescaled only when a row's running max grows by more than lazy_tau (base 2), 0 = every tile.
    min_rows: quantized caches pad the G query rows of a KV group to at least this many (16 = one
    MMA tile; fewer lets Triton pad inside the instruction with fewer accumulator registers).
    swap_block_n >= 16 dividing the block size: int8 with fp16 compute goes to triton_decode_swap
    (tokens on the MMA's M side, V folds always on) with tiles of this many tokens instead of block_n
    (the PV product's inner dimension is the tile, and the tensor-core dot needs at least 16);
    swap_maxnreg and swap_stages are its register cap and pipeline depth instead of maxnreg and
    num_stages (0 = none / num_stages); swap_merge: its splits are merged inside the kernel by the
    last program of each (sequence, KV head) (merge_if_last), not by a reduce launch. int8 values are
    never read as words (dims-major, nanokv.kv.cache). swap4: int4 (with fold_k) goes to the transposed
    int4 kernel (triton_decode_swap4) under the same tile rule, instead of triton_decode_int4, with its own
    register cap (swap4_maxnreg) and tile-ahead metadata loads (swap4_prefetch). cuda4: such int4 decodes
    run the CUDA C++ kernel instead where it applies (cuda_decode_int4.supported), capped at
    cuda4_maxnreg, with a cuda4_stages-deep copy ring and cuda4_tiles 16-token tiles per loop step
    (cuda4_direct: launched through cuda_decode_int4._Launcher).
    fill_slots ([B] int64, the step's slot of each row's token, -1 = none): when the CUDA kernel serves
    the call, it also quantizes the staged blocks these tokens complete (the quantize-on-fill of
    compute_service.kv_hooks.after_attention), and paged_decode returns True (the caller tells
    after_attention, AttentionMetadata.fills_quantized, which then skips its own fill launch); False
    otherwise. seq_order ([B] int64, rows longest first): the CUDA kernel starts the programs of longer
    sequences first."""
    B, Hq, D = q.shape
    H = cache.num_kv_heads
    if B == 0:
        return False
    assert Hq % H == 0 and D % 2 == 0 and q.stride(-1) == 1 and out.stride(-1) == 1
    check_layout(cache)
    G = Hq // H
    ks, vs, kz, vz = kv_meta_args(cache)
    kst, vst, stage_of, *strides = stage_args(cache)
    cdt = compute_dtype(q.dtype, cache.bits)
    words = use_words(cache.quantized, cdt, D) if words is None else words
    transposed = runs_transposed(cache.bits, swap_block_n, words, cache.block_size, int4=swap4 and fold_k)
    # uint8 key codes for both int4 kernels (int8 tiles for the transposed int8 one), else code_args' views
    k, v = code_args(cache, words, byte_keys=transposed or (cache.bits == 4 and fold_k))
    split = num_splits > 1
    if split:
        buf = _buffer("partials", q.device, B * Hq * num_splits * (D + 2), torch.float32)
        part_o, part_ml = buf[:B * Hq * num_splits * D], buf[B * Hq * num_splits * D:]
    else:
        part_o = part_ml = out  # unused
    args = (q, k, v, ks, vs, kz, vz, kst, vst, stage_of, block_tables, seq_lens, out, part_o, part_ml,
            scale * LOG2E, num_splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            cache.k.stride(0), cache.k.stride(1), cache.k.stride(2),
            vs.stride(0) if cache.quantized else 0, vs.stride(1) if cache.quantized else 0,
            block_tables.stride(0), *strides)
    common = dict(D=D, DH=D // 2, G=G, BS=cache.block_size, CDT=cdt, WORDS=words, FOLD_V=fold_v,
                  ASM=use_asm(q.device) if asm is None else asm, BLOCK_DH=max(16, next_pow2(D // 2)),
                  BLOCK_N=block_n, SPLIT=split, LAZY_TAU=lazy_tau, num_warps=num_warps, num_stages=num_stages,
                  **({"maxnreg": maxnreg} if maxnreg > 0 else {}))
    merged = filled = False
    if transposed:
        common.update(BLOCK_N=swap_block_n, num_stages=swap_stages or num_stages)
        common.pop("maxnreg", None)
        cap = swap4_maxnreg if cache.bits == 4 else swap_maxnreg
        if cap > 0:
            common["maxnreg"] = cap
        merged = split and swap_merge
        counts = _buffer("counts", q.device, B * H, torch.int32) if merged else seq_lens  # (unused unless merged)
        swap = dict(count_ptr=counts, **common, BLOCK_G=next_pow2(G), MERGE=merged, BLOCK_S=next_pow2(num_splits))
        if isinstance(cache, Int4KV):  # the CUDA kernel where it applies and runs, else Triton's
            cuda_ran = cuda4 and (merged or not split) and cuda_decode_int4.try_decode(
                q, cache, block_tables, seq_lens, out, scale * LOG2E, num_splits, part_o, part_ml, counts,
                cuda4_maxnreg, cuda4_stages, fill_slots, seq_order, cuda4_tiles, cuda4_direct)
            filled = cuda_ran and fill_slots is not None
            if not cuda_ran:
                decode_int4_swap_kernel[(B, H, num_splits)](
                    *args, stride_vd=cache.v.stride(3), stride_vt=cache.v.stride(2), PREFETCH=swap4_prefetch, **swap)
        else:
            decode_int8_swap_kernel[(B, H, num_splits)](*args, **swap)
    elif cache.bits == 4 and fold_k:
        decode_int4_kernel[(B, H, num_splits)](*args, **common,
                                               **int4_tiles(G, cache.block_size, block_n, min_rows))
    else:
        _decode_kernel[(B, H, num_splits)](*args, **common, BITS=cache.bits if cache.quantized else 16,
                                           BLOCK_G=max(min_rows if cache.quantized else 16, next_pow2(G)))
    if split and not merged:
        _reduce_kernel[(B, Hq)](part_o, part_ml, out, num_splits, out.stride(0), out.stride(1),
                                D=D, BLOCK_S=next_pow2(num_splits), BLOCK_D=next_pow2(D), num_warps=4)
    return filled
