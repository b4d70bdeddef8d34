"""The K/V tile math of the hybrid-sparsity kernels: one table mixes pool blocks, demoted slots and holes.

Under hybrid sparsity (nanokv.kv.demote) a block-table entry e of an int8 layer is
    e >= 0    pool block e: int8 codes, one symmetric float16 scale per (token, head) row
    e == -1   a hole (dropped): no keys, positions unchanged
    e <= -2   slot -2 - e of the layer's INT4 demotion store: packed nibbles (dim d low, d + D/2 high),
              one asymmetric float16 (scale, zero) per (token, head) row: x = code * scale + zero
The table is the same int32 tensor as for any other step, so nothing about a launch changes with how
many blocks are demoted (static shapes: CUDA-graph safe).

As the int8 kernels do (triton_kvtile), codes stay codes: both sources are read as raw codes in the
compute dtype (int8 -128..127 and nibbles 0..15 are exact in fp16) and the per-row ranges are folded
into the [rows, BLOCK_N] products, never applied to a [BLOCK_N, D] tile:
    K  s = (q . c) * scale + (sum_d q) * zero        (pool rows: zero 0; holes: -inf)
    V  acc += (p * scale) @ c,  plus (p . zero) on every dim (kept apart as one number per row)
Each source is read with its own row mask (a masked lane fetches nothing, so a tile costs the bytes
of what it holds) and reads 0 elsewhere, so the two key tiles merge by one add. Value codes are not
merged: int8 values are dims-major (nanokv.kv.cache) and go to the tensor cores as the int8 kernels
take them (tokens contiguous, runs of a block), the store's token-major nibbles as a second product.
Dims are split in halves [0, D/2) and [D/2, D), the nibbles' layout, so neither source needs a shuffle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton_dequant import int8_tile_f16, load_code_words
from nanokv.kernels.triton_kvtile import fold_v_weights
from nanokv.kv.cache import is_transposed
from nanokv.kv.demote import HybridInt8KV


@triton.jit
def tile_entries(bt_row_ptr, tok, hi, BS: tl.constexpr):
    """tok: [BLOCK_N] positions -> (entry [BLOCK_N] int32, valid): valid = inside [0, hi), not a hole."""
    in_range = tok < hi
    entry = tl.load(bt_row_ptr + tok // BS, mask=in_range, other=-1)
    return entry, in_range & (entry != -1)


@triton.jit
def tile_rows(entry, valid, tok, kvh, c_n, c_h, c_s, s_n, s_h, s_s, p_n, p_h, p_s, a_n, a_h, a_s, BS: tl.constexpr):
    """Per token of a tile: (pool mask, slot mask, pool code row, pool scale row, store code row, store
    scale/zero row), int64 offsets by the strides of tile_args (K and V sources share them)."""
    pool = valid & (entry >= 0)
    slot = valid & (entry <= -2)
    b = tl.where(pool, entry, 0).to(tl.int64)
    j = tl.where(slot, -2 - entry, 0).to(tl.int64)
    off = tok % BS
    return (pool, slot, b * c_n + kvh * c_h + off * c_s, b * s_n + kvh * s_h + off * s_s,
            j * p_n + kvh * p_h + off * p_s, j * a_n + kvh * a_h + off * a_s)


@triton.jit
def _int8_codes(c8, rows, pool, offs_d, d_mask, CDT: tl.constexpr, DH: tl.constexpr, WORDS: tl.constexpr,
                ASM: tl.constexpr):
    """Token-major int8 codes -> (dims [0, D/2), dims [D/2, D)) [BLOCK_N, BLOCK_DH] in CDT, 0 off `pool`.
    rows: byte offsets of each token's row. WORDS: c8 is an int32 view, read as words and expanded in
    registers (triton_dequant), as the int8 kernels read keys; else byte tiles (fp32 compute, odd dims)."""
    if WORDS:
        lo = load_code_words(c8, rows, pool, 0, rows.shape[0], offs_d.shape[0], 8, ASM)
        hi = load_code_words(c8, rows, pool, 1, rows.shape[0], offs_d.shape[0], 8, ASM)
    else:
        m = pool[:, None] & d_mask[None, :]
        lo = tl.load(c8 + rows[:, None] + offs_d[None, :], mask=m, other=0).to(CDT)
        hi = tl.load(c8 + rows[:, None] + DH + offs_d[None, :], mask=m, other=0).to(CDT)
    return lo, hi


@triton.jit
def _int4_codes(c4, rows, slot, offs_d, d_mask, CDT: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr):
    """Packed nibbles (token-major [D/2] bytes a row) -> (low, high) [BLOCK_N, BLOCK_DH] in CDT, 0 off
    `slot`; as _int8_codes."""
    if WORDS:
        lo, hi = load_code_words(c4, rows, slot, 0, rows.shape[0], offs_d.shape[0], 4, ASM)
    else:
        packed = tl.load(c4 + rows[:, None] + offs_d[None, :], mask=slot[:, None] & d_mask[None, :], other=0)
        lo, hi = (packed & 15).to(CDT), (packed >> 4).to(CDT)
    return lo, hi


@triton.jit
def key_scores(q_lo, q_hi, q_sum, valid, pool, slot, crow, srow, prow, arow, offs_d, d_mask, qk_scale,
               kc, ks, kp, ka, kz, DH: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr):
    """Scores [ROWS, BLOCK_N] fp32 of one tile, times qk_scale, -inf where not valid. q_lo, q_hi:
    [ROWS, BLOCK_DH] query halves in the compute dtype; q_sum [ROWS] fp32 their sum over all dims;
    pool .. arow: tile_rows. kc/ks: the pool's codes [N, H, bs, D] and scales [N, H, bs]; kp/ka/kz:
    the store's packed codes [M, H, bs, D/2], scales and zeros [M, H, bs]."""
    a_lo, a_hi = _int8_codes(kc, crow, pool, offs_d, d_mask, q_lo.dtype, DH, WORDS, ASM)
    b_lo, b_hi = _int4_codes(kp, prow, slot, offs_d, d_mask, q_lo.dtype, WORDS, ASM)
    s = tl.dot(q_hi, tl.trans(a_hi + b_hi), tl.dot(q_lo, tl.trans(a_lo + b_lo)))  # (one of each pair is 0)
    scale = (tl.load(ks + srow, mask=pool, other=0.0).to(tl.float32)
             + tl.load(ka + arow, mask=slot, other=0.0).to(tl.float32)) * qk_scale
    zero = tl.load(kz + arow, mask=slot, other=0.0).to(tl.float32) * qk_scale
    return tl.where(valid[None, :], s * scale[None, :] + q_sum[:, None] * zero[None, :], float("-inf"))


@triton.jit
def _pool_value_codes(vc, bt_row_ptr, start, hi, kvh, c_n, c_h, offs_d, d_mask, HALF: tl.constexpr,
                      DH: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, CDT: tl.constexpr,
                      ASM: tl.constexpr):
    """int8 value codes of tokens [start, start + BLOCK_N) (start % BLOCK_N == 0), dims HALF * DH + offs_d,
    as a [BLOCK_N, BLOCK_DH] tile in CDT. The pool's values are dims-major ([N, H, D, bs] in memory), so
    the tile is read as NB runs of TB tokens sharing a block, tokens contiguous (one table read per run),
    runs not in a pool block masked (0), converted in the load layout (triton_vcodes reads int8 caches so)."""
    TB: tl.constexpr = BS if BS < BLOCK_N else BLOCK_N
    NB: tl.constexpr = BLOCK_N // TB
    tok0 = start + tl.arange(0, NB) * TB  # [NB] first token of each run
    e = tl.load(bt_row_ptr + tok0 // BS, mask=tok0 < hi, other=-1)
    base = tl.maximum(e, 0).to(tl.int64) * c_n + kvh * c_h + tok0 % BS
    ptr = vc + base[:, None, None] + (HALF * DH + offs_d)[None, :, None] * BS + tl.arange(0, TB)[None, None, :]
    c = tl.load(ptr, mask=(e >= 0)[:, None, None] & d_mask[None, :, None], other=0)  # [NB, BLOCK_DH, TB]
    c = int8_tile_f16(c, ASM) if CDT == tl.float16 else c.to(CDT)
    BLOCK_DH: tl.constexpr = offs_d.shape[0]
    return tl.trans(tl.reshape(tl.permute(c, (1, 0, 2)), [BLOCK_DH, BLOCK_N]))


@triton.jit
def value_accumulate(p, acc_lo, acc_hi, pool, slot, srow, prow, arow, start, hi, bt_row_ptr, kvh, offs_d, d_mask,
                     vc, c_n, c_h, vs, vp, va, vz, BS: tl.constexpr, DH: tl.constexpr, CDT: tl.constexpr,
                     WORDS: tl.constexpr, ASM: tl.constexpr):
    """acc += p @ V over one tile of tokens [start, start + BLOCK_N) -> (acc_lo, acc_hi, z [ROWS]):
    the caller adds z = p . zero (the store rows' offsets) to every dim, here left out of the [ROWS,
    BLOCK_DH] accumulators. p: [ROWS, BLOCK_N] fp32, 0 on tokens not valid. vc: the pool's values
    (dims-major; c_n, c_h its block and head strides), vs their scales; vp/va/vz: the store's packed
    values [M, H, bs, D/2], scales, zeros. Each source's scale goes into p (fold_v_weights: p * scale
    <= 65504 in fp16), 0 on the other's tokens."""
    BLOCK_N: tl.constexpr = p.shape[1]
    a_lo = _pool_value_codes(vc, bt_row_ptr, start, hi, kvh, c_n, c_h, offs_d, d_mask, 0, DH, BS, BLOCK_N, CDT, ASM)
    a_hi = _pool_value_codes(vc, bt_row_ptr, start, hi, kvh, c_n, c_h, offs_d, d_mask, 1, DH, BS, BLOCK_N, CDT, ASM)
    b_lo, b_hi = _int4_codes(vp, prow, slot, offs_d, d_mask, CDT, WORDS, ASM)
    p8 = fold_v_weights(p, tl.load(vs + srow, mask=pool, other=0.0), CDT)
    p4 = fold_v_weights(p, tl.load(va + arow, mask=slot, other=0.0), CDT)
    acc_lo = tl.dot(p4, b_lo, tl.dot(p8, a_lo, acc_lo))
    acc_hi = tl.dot(p4, b_hi, tl.dot(p8, a_hi, acc_hi))
    return acc_lo, acc_hi, tl.sum(p * tl.load(vz + arow, mask=slot, other=0.0).to(tl.float32)[None, :], 1)


def tile_args(cache: HybridInt8KV, words: bool) -> tuple:
    """The kernels' source arguments: (kc, vc, c_n, c_h, c_s, ks, vs, s_n, s_h, s_s, kp, vp, p_n, p_h, p_s,
    ka, kz, va, vz, a_n, a_h, a_s): pool codes (int8 keys as int32 views where read as words) and
    their strides (V's dims-major view shares K's block and head strides, nanokv.kv.cache), pool scales,
    store codes (as words likewise; byte strides), store scales and zeros: one stride set per kind."""
    st = cache.demoted
    k, v, bs = cache.k, cache.v, cache.block_size
    metas = (st.k_scale, st.k_zero, st.v_scale, st.v_zero)
    if (k.stride(-1) != 1 or not is_transposed(v) or v.stride()[:2] != k.stride()[:2]
            or cache.k_scale.stride() != cache.v_scale.stride() or st.k.stride(-1) != 1
            or st.k.stride() != st.v.stride() or any(m.stride() != metas[0].stride() for m in metas)):
        raise ValueError(f"hybrid attention: k strides {k.stride()}, v {v.stride()} (bs {bs}), store k "
                         f"{st.k.stride()}, v {st.v.stride()}: int8 values dims-major, other codes dims-contiguous, "
                         "K and V strides alike")

    def codes(x: torch.Tensor) -> torch.Tensor:
        return x.view(torch.int32) if words else x

    return (codes(k), v, *k.stride()[:3], cache.k_scale, cache.v_scale, *cache.k_scale.stride(),
            codes(st.k), codes(st.v), *st.k.stride()[:3], *metas, *st.k_scale.stride())


def check(q: torch.Tensor, cache: HybridInt8KV, out: torch.Tensor) -> tuple[int, int, int]:
    """(Hq, D, G) of a call, after the layout checks the kernels rely on."""
    _, Hq, D = q.shape
    H = cache.num_kv_heads
    if Hq % H or D % 2 or q.stride(-1) != 1 or out.stride(-1) != 1 or cache.demoted.k.shape[-1] * 2 != D:
        raise ValueError(f"hybrid attention: q {tuple(q.shape)} over {H} KV heads of dim {cache.head_dim}")
    return Hq, D, Hq // H
