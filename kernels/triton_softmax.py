"""Online softmax for the attention kernels (base 2) and the decode epilogue.

Scores arrive already scaled by softmax_scale * log2(e), so exp2 replaces exp. A row whose keys are
all masked so far keeps m = -inf and contributes nothing. The decode kernels may rescale their
accumulators lazily (lazy_softmax_update): only when a running max grows by more than TAU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softmax_update(s, m_i, l_i):
    """One flash-attention update in base 2, accumulators left to the caller: returns (p, alpha,
    m_new, l_new); the caller scales its accumulators by alpha[:, None]. s: [BLOCK_M, BLOCK_N] fp32
    scores already scaled by softmax_scale * log2(e), -inf where masked. Rows whose keys are all
    masked so far keep m = -inf and contribute nothing (the `m_safe` guard avoids -inf - -inf = NaN)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def softmax_update_t(st, m_i, l_i):
    """softmax_update on transposed scores st [BLOCK_N, ROWS] (the transposed decodes: tokens on
    axis 0): returns (p^T, alpha, m_new, l_new)."""
    m_new = tl.maximum(m_i, tl.max(st, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    pt = tl.exp2(st - m_safe[None, :])
    return pt, alpha, m_new, l_i * alpha + tl.sum(pt, axis=0)


@triton.jit
def lazy_softmax_update(s, m_i, l_i, TAU: tl.constexpr):
    """softmax_update that keeps each row's reference max until some row's max grows by more than
    TAU (base 2; FlashAttention-4's conditional rescaling). Returns (p, alpha, m_ref, l_new, grow):
    when grow is False alpha is exactly 1 (or 0 on rows with no key yet, whose accumulators are 0),
    so the caller may skip rescaling its accumulators. p <= 2^TAU instead of 1."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    grow = tl.max(m_new - m_i, axis=0) > TAU  # a first key gives +inf; no key yet: NaN, compares False
    m_ref = tl.where(grow, m_new, m_i)
    m_safe = tl.where(m_ref == float("-inf"), 0.0, m_ref)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_ref, l_i * alpha + tl.sum(p, axis=1), grow


@triton.jit
def decode_softmax_step(s, m_i, l_i, acc_lo, acc_hi, LAZY_TAU: tl.constexpr):
    """The decode kernels' online-softmax update: (p, alpha, m, l, acc_lo, acc_hi), the accumulators
    rescaled after every tile, or with LAZY_TAU > 0 only when lazy_softmax_update asks for it."""
    if LAZY_TAU > 0:
        p, alpha, m_i, l_i, grow = lazy_softmax_update(s, m_i, l_i, LAZY_TAU)
        if grow:
            acc_lo = acc_lo * alpha[:, None]
            acc_hi = acc_hi * alpha[:, None]
    else:
        p, alpha, m_i, l_i = softmax_update(s, m_i, l_i)
        acc_lo = acc_lo * alpha[:, None]
        acc_hi = acc_hi * alpha[:, None]
    return p, alpha, m_i, l_i, acc_lo, acc_hi


@triton.jit
def online_softmax_step(s, m_i, l_i, acc_lo, acc_hi):
    """softmax_update with the two output halves rescaled: (p, m_new, l_new, acc_lo, acc_hi)."""
    p, alpha, m_new, l_i = softmax_update(s, m_i, l_i)
    return p, m_new, l_i, acc_lo * alpha[:, None], acc_hi * alpha[:, None]


@triton.jit
def store_decode(acc_lo, acc_hi, m_i, l_i, offs_g, kvh, seq, split, num_splits, out_ptr, part_o_ptr,
                 part_ml_ptr, stride_ot, stride_oh, D: tl.constexpr, DH: tl.constexpr, G: tl.constexpr,
                 BLOCK_DH: tl.constexpr, SPLIT: tl.constexpr):
    """Decode epilogue for rows offs_g (query heads kvh * G + offs_g, those >= G are padding):
    acc [ROWS, BLOCK_DH] fp32 halves, m_i and l_i [ROWS] in base 2. One split: out = acc / l.
    Several: the normalized partial and (m, l), merged by triton_decode's reduce kernel."""
    offs_d = tl.arange(0, BLOCK_DH)
    g_mask = offs_g < G
    heads = kvh * G + offs_g
    qm = g_mask[:, None] & (offs_d < DH)[None, :]
    inv_l = 1.0 / tl.where(l_i > 0, l_i, 1.0)  # acc is 0 where l is: an all-hole context gives 0, not NaN
    o_lo = acc_lo * inv_l[:, None]
    o_hi = acc_hi * inv_l[:, None]
    if SPLIT:
        # part_o: [num_decodes, Hq, num_splits, D] fp32; part_ml: [2, num_decodes, Hq, num_splits]
        Hq = tl.num_programs(1) * G
        prow = (seq * Hq + heads) * num_splits + split  # [ROWS]
        po = part_o_ptr + prow[:, None].to(tl.int64) * D + offs_d[None, :]
        tl.store(po, o_lo, mask=qm)
        tl.store(po + DH, o_hi, mask=qm)
        n_part = tl.num_programs(0) * Hq * num_splits
        tl.store(part_ml_ptr + prow, m_i, mask=g_mask)
        tl.store(part_ml_ptr + n_part + prow, l_i, mask=g_mask)
    else:
        o_rows = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_rows, o_lo.to(out_ptr.dtype.element_ty), mask=qm)
        tl.store(o_rows + DH, o_hi.to(out_ptr.dtype.element_ty), mask=qm)


@triton.jit
def merge_splits(part_o_ptr, part_ml_ptr, out_ptr, seq, head, Hq, num_splits, stride_ot, stride_oh,
                 D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, CACHE: tl.constexpr):
    """out[seq, head] = the splits' partials (store_decode's layout) merged with their softmax
    weights. CACHE: the loads' cache modifier (".cg" when other programs of this launch wrote them:
    L1 is not coherent across SMs)."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    prow = (seq * Hq + head) * num_splits + offs_s
    n_part = tl.num_programs(0) * Hq * num_splits
    m = tl.load(part_ml_ptr + prow, mask=s_mask, other=float("-inf"), cache_modifier=CACHE)
    l = tl.load(part_ml_ptr + n_part + prow, mask=s_mask, other=0.0, cache_modifier=CACHE)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = l * tl.exp2(m - m_safe)  # [BLOCK_S]; empty splits have l = 0
    w_sum = tl.sum(w, axis=0)
    w = w / tl.where(w_sum > 0, w_sum, 1.0)
    o = tl.load(part_o_ptr + prow[:, None].to(tl.int64) * D + offs_d[None, :],
                mask=s_mask[:, None] & (offs_d[None, :] < D), other=0.0, cache_modifier=CACHE)
    res = tl.sum(o * w[:, None], axis=0)  # [BLOCK_D]
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty),
             mask=offs_d < D)


@triton.jit
def merge_if_last(count_ptr, part_o_ptr, part_ml_ptr, out_ptr, seq, kvh, num_splits, stride_ot, stride_oh,
                  D: tl.constexpr, G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """The split-K merge inside the decode kernel, after store_decode wrote this program's partials:
    the last of a (sequence, KV head)'s num_splits programs to finish merges the group's G heads, so
    no reduce launch follows (its launch and tail were ~0.2 s of the H200 long-context run at 8
    splits). count_ptr: [num_decodes * num_kv_heads] int32, zero before the launch; the merging
    program sets its counter back to zero for the next one."""
    c_ptr = count_ptr + seq * tl.num_programs(1) + kvh
    tl.debug_barrier()  # every thread's partial stores come before the (one-thread) release below
    n_done = tl.atomic_add(c_ptr, 1, sem="acq_rel")
    if n_done == num_splits - 1:
        Hq = tl.num_programs(1) * G
        for g in tl.static_range(G):
            merge_splits(part_o_ptr, part_ml_ptr, out_ptr, seq, kvh * G + g, Hq, num_splits, stride_ot,
                         stride_oh, D, BLOCK_S, BLOCK_D, ".cg")
        tl.store(c_ptr, 0)
