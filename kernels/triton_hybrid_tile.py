"""The K/V tile read of the hybrid-sparsity kernels: one table mixes pool blocks, demoted slots and holes.

Under hybrid sparsity (nanokv.kv.demote) a block-table entry e of an int8 layer is
    e >= 0    pool block e: int8 codes, one symmetric float16 scale per (token, head) row
    e == -1   a hole (dropped): no keys, positions unchanged
    e <= -2   slot -2 - e of the layer's INT4 demotion store: packed nibbles (dim d low, d + D/2 high),
              one asymmetric float16 (scale, zero) per (token, head) row
The table is the same int32 tensor as for any other step, so nothing about a launch changes with how
many blocks are demoted (static shapes: CUDA-graph safe). Each token of a tile looks its entry up and
the two sources are read with complementary masks: a masked lane fetches nothing, so a tile costs the
bytes of what it really holds. Tiles are split in two halves of D/2 dims (lo = dims [0, D/2), hi =
[D/2, D)), the layout of the int4 nibbles, so neither source needs a shuffle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanokv.kv.demote import HybridInt8KV


@triton.jit
def tile_entries(bt_row_ptr, tok, hi, BS: tl.constexpr):
    """tok: [BLOCK_N] positions -> (entry [BLOCK_N] int32, valid): valid = inside [0, hi), not a hole."""
    in_range = tok < hi
    entry = tl.load(bt_row_ptr + tok // BS, mask=in_range, other=-1)
    return entry, in_range & (entry != -1)


@triton.jit
def hybrid_tile(entry, valid, tok, kvh, offs_d, d_mask,
                c_ptr, sc_n, sc_h, sc_s, sc_d, s_ptr, ss_n, ss_h, ss_s,
                p_ptr, sp_n, sp_h, sp_s, a_ptr, z_ptr, sa_n, sa_h, sa_s,
                BS: tl.constexpr, DH: tl.constexpr):
    """One tile of K (or V) -> (lo, hi) float32 [BLOCK_N, BLOCK_DH], zero where not valid.
    c/s: the int8 pool's codes [N, H, bs, D] (any strides) and scales [N, H, bs];
    p/a/z: the store's packed codes [M, H, bs, D/2] (dims contiguous), scales and zeros [M, H, bs]."""
    pool = valid & (entry >= 0)
    slot = valid & (entry <= -2)
    off = (tok % BS).to(tl.int64)
    b = tl.where(pool, entry, 0).to(tl.int64)
    j = tl.where(slot, -2 - entry, 0).to(tl.int64)
    m8 = pool[:, None] & d_mask[None, :]
    base8 = c_ptr + (b * sc_n + kvh * sc_h + off * sc_s)[:, None]
    lo8 = tl.load(base8 + offs_d[None, :] * sc_d, mask=m8, other=0).to(tl.float32)
    hi8 = tl.load(base8 + (offs_d[None, :] + DH) * sc_d, mask=m8, other=0).to(tl.float32)
    s8 = tl.load(s_ptr + b * ss_n + kvh * ss_h + off * ss_s, mask=pool, other=0).to(tl.float32)
    m4 = slot[:, None] & d_mask[None, :]
    byte = tl.load(p_ptr + (j * sp_n + kvh * sp_h + off * sp_s)[:, None] + offs_d[None, :], mask=m4, other=0)
    arow = j * sa_n + kvh * sa_h + off * sa_s
    s4 = tl.load(a_ptr + arow, mask=slot, other=0).to(tl.float32)
    z4 = tl.load(z_ptr + arow, mask=slot, other=0).to(tl.float32)
    lo4 = (byte & 15).to(tl.float32) * s4[:, None] + z4[:, None]
    hi4 = (byte >> 4).to(tl.float32) * s4[:, None] + z4[:, None]
    lo = tl.where(pool[:, None], lo8 * s8[:, None], lo4)  # (lo4 is 0 where no slot: codes, scale, zero 0)
    hi = tl.where(pool[:, None], hi8 * s8[:, None], hi4)
    return lo, hi


@triton.jit
def online_step(s, m_i, l_i, acc_lo, acc_hi, v_lo, v_hi, CDT: tl.constexpr):
    """One tile of the online softmax in base 2. s: [R, BLOCK_N] scores (-inf = no key); a row that has
    seen no key yet keeps m = -inf, l = 0 and a zero accumulator (no NaN from -inf - -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pc = p.to(CDT)
    acc_lo = acc_lo * alpha[:, None] + tl.dot(pc, v_lo.to(CDT))
    acc_hi = acc_hi * alpha[:, None] + tl.dot(pc, v_hi.to(CDT))
    return m_new, l_i, acc_lo, acc_hi


def tile_args(cache: HybridInt8KV) -> tuple:
    """The K then the V source arguments of hybrid_tile, in its order (pool view strides: int8 V is a
    dims-major view, its logical strides say so)."""
    st = cache.demoted
    out: list = []
    for c, s, p, a, z in ((cache.k, cache.k_scale, st.k, st.k_scale, st.k_zero),
                          (cache.v, cache.v_scale, st.v, st.v_scale, st.v_zero)):
        if p.stride(-1) != 1 or a.stride() != z.stride():
            raise ValueError("the demotion store's codes must be dims-contiguous, its scales and zeros alike")
        out += [c, *c.stride(), s, *s.stride(), p, *p.stride()[:3], a, z, *a.stride()]
    return tuple(out)


def check(q: torch.Tensor, cache: HybridInt8KV, out: torch.Tensor) -> tuple[int, int, int]:
    """(Hq, D, G) of a call, after the layout checks the kernels rely on."""
    _, Hq, D = q.shape
    H = cache.num_kv_heads
    if Hq % H or D % 2 or q.stride(-1) != 1 or out.stride(-1) != 1 or cache.demoted.k.shape[-1] * 2 != D:
        raise ValueError(f"hybrid attention: q {tuple(q.shape)} over {H} KV heads of dim {cache.head_dim}")
    return Hq, D, Hq // H
