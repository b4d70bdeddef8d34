"""Batch-invariant CPU attention: a token's output does not depend on how its step was formed.

With `batch_invariant=True` (CPU, torch backend) every query is computed by the same sequence of
float operations whatever else shares its step: a whole prompt, the same prompt in 64-token chunks,
its tail after a prefix-cache hit, a preempted sequence recomputed, a decode batch of any size. The
default paths do not guarantee that: SDPA's blocking and the padded batch decode change with the
number of queries and the longest context, so results differ in the last bits, and a compressed
cache can turn such a bit into a different code (docs/quality.md, "Greedy output and compressed
caches").

How. Each sequence is attended on its own, keys in fixed TILE-wide tiles at absolute positions
[0, TILE), [TILE, 2 TILE), ... with an online softmax across tiles in that order:
  - each tile's two products have fixed inner dimensions (D, then TILE), and a query row's result
    of a CPU matmul does not depend on the other rows once there are at least 4 of them (measured
    on this project's CPUs; tests/kernels/test_batch_invariant.py checks it), so rows are padded to 4;
  - keys past a query's position are masked to exactly 0 weight, so a tile that is entirely in a
    query's future leaves its running sums bit for bit unchanged (alpha = exp(0) = 1, p = 0): a
    chunk that stops earlier, and so skips those tiles, gets the same bits.
The linear layers are made invariant the same way (nanokv.compute_service.model.layers.linear, rows padded).

int4 (blocks quantized when they fill, open blocks staged in full precision): one read rule for
every path, the decode kernels' rule: a key in the query's own block is read from staging, every
other key quantized, also in a block this very step filled (its codes are computed here exactly as
nanokv.kv.blockquant.quantize_filled will store them after the step). The default paths instead
read every staged block in full precision, so a prompt prefilled whole saw its earlier blocks
unquantized and the same prompt in chunks did not.
"""

from __future__ import annotations

import torch

from nanokv.kernels.reference import _key_valid, gather_kv_heads
from nanokv.kv import quant
from nanokv.kv.cache import Int4KV, LayerKV
from nanokv.kv.metadata import AttentionMetadata

TILE = 256  # keys per tile: fixed, or the P @ V sums would change with the context length
MIN_ROWS = 4  # fewer query rows change a CPU matmul's rounding (measured: 1-3 rows differ)


def paged_attention(q: torch.Tensor, cache: LayerKV, md: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D]; this step's K/V are already stored. Prefill chunks and
    decodes take the same path: a decode is a one-token chunk."""
    T, Hq, D = q.shape
    H, bs = cache.num_kv_heads, cache.block_size
    G = Hq // H
    out = torch.empty_like(q)
    qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
    # every sequence's K/V in one gather (dequantization is elementwise: each value is the one a
    # gather of its own blocks gives), in whole tiles: blocks past a context read block 0, masked
    nbs = [-(-(-(-L // TILE) * TILE) // bs) for L in lens]
    NB = max(nbs)
    tables = md.block_tables[:, :NB]
    if tables.shape[1] < NB:
        tables = torch.cat([tables, tables.new_full((tables.shape[0], NB - tables.shape[1]), -1)], dim=1)
    K, V = gather_kv_heads(cache, tables, q.dtype)  # [B, H, NB * bs, D]
    VALID = _key_valid(tables, bs, md.seq_lens)  # [B, NB * bs]
    for i in range(md.num_seqs):
        s, e, L, nb = qsl[i], qsl[i + 1], lens[i], nbs[i]
        M = e - s
        ntile = -(-L // TILE)
        ids = tables[i, :nb]
        k, v, valid = K[i, :, :nb * bs], V[i, :, :nb * bs], VALID[i, :nb * bs]
        kq, vq = _quantized_view(cache, ids, k, v, (L - 1) // bs) if isinstance(cache, Int4KV) else (None, None)
        # rows (g, m): head kvh * G + g of query m, [H, G * M, D]
        rows = q[s:e].reshape(M, H, G, D).permute(1, 2, 0, 3).reshape(H, G * M, D)
        R = max(G * M, MIN_ROWS)
        if R > G * M:
            rows = torch.cat([rows, rows.new_zeros(H, R - G * M, D)], dim=1)
        qpos = torch.arange(L - M, L, device=q.device).repeat(G)  # [G * M]
        qpos = torch.cat([qpos, qpos.new_full((R - G * M,), L - 1)])
        o = _tiled(rows, k, v, valid, qpos, scale, ntile, kq, vq, bs)  # [H, R, D]
        out[s:e] = o[:, :G * M].reshape(H, G, M, D).permute(2, 0, 1, 3).reshape(M, Hq, D)
    return out


def _quantized_view(cache: Int4KV, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor, last: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """int4: K, V [H, nb * bs, D] as gathered (staged blocks in full precision) -> the same with
    every staged block before block `last` (the newest query's) replaced by its quantize-dequantize
    round trip (blockquant's functions on the same staging rows, so bit for bit what the pool will
    hold once the block is quantized). Block `last` and later are only ever read by their own rows
    or masked, so they are left as they are: a decode step round-trips nothing."""
    H, _, D = k.shape
    bs = cache.block_size
    st = torch.where(ids >= 0, cache.stage.stage_of[ids.clamp_min(0)].long(), -1)  # [nb]
    sel = ((st >= 0) & (torch.arange(st.numel(), device=st.device) < last)).nonzero().flatten()
    if sel.numel() == 0:
        return k, v
    kb, vb = cache.k_stage[st[sel]], cache.v_stage[st[sel]]  # [F, H, bs, D]
    k_rt = quant.dequantize_int4_channels(*quant.quantize_int4_channels(kb), k.dtype)
    v_rt = quant.dequantize_int4(*quant.quantize_int4(vb), v.dtype)
    kq = k.clone(memory_format=torch.contiguous_format).view(H, -1, bs, D)  # k, v may be strided views
    vq = v.clone(memory_format=torch.contiguous_format).view(H, -1, bs, D)
    kq[:, sel], vq[:, sel] = k_rt.transpose(0, 1), v_rt.transpose(0, 1)
    return kq.view(H, -1, D), vq.view(H, -1, D)


def _tiled(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, qpos: torch.Tensor,
           scale: float, ntile: int, kq: torch.Tensor | None = None, vq: torch.Tensor | None = None,
           bs: int = 1) -> torch.Tensor:
    """Online softmax over key tiles in order. rows [H, R, D]; k, v [H, ntile * TILE (or more), D];
    valid [keys] (not a hole, inside the context); qpos [R] each row's position. kq, vq (int4):
    the quantized view, read for every key outside the row's own block of bs tokens."""
    H, R, D = rows.shape
    m = rows.new_full((H, R, 1), float("-inf"), dtype=torch.float32)
    l = rows.new_zeros((H, R, 1), dtype=torch.float32)
    acc = rows.new_zeros((H, R, D), dtype=torch.float32)
    rf = rows.float()
    for t in range(ntile):
        a, b = t * TILE, (t + 1) * TILE
        kpos = torch.arange(a, b, device=rows.device)
        keep = (kpos[None, :] <= qpos[:, None]) & valid[a:b][None, :]  # [R, TILE]
        kt = k[:, a:b].float()
        vt = v[:, a:b].float().masked_fill(~valid[a:b][None, :, None], 0.0)  # stale slots: no NaN * 0
        sc = torch.matmul(rf, kt.transpose(1, 2))
        if kq is not None and vq is not None:
            own = (kpos // bs)[None, :] == (qpos // bs)[:, None]  # [R, TILE]
            sc = torch.where(own, sc, torch.matmul(rf, kq[:, a:b].float().transpose(1, 2)))
        sc = sc.mul_(scale).masked_fill_(~keep, float("-inf"))
        m_new = torch.maximum(m, sc.amax(dim=-1, keepdim=True))
        m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(sc - m_safe)
        l = l * alpha + p.sum(dim=-1, keepdim=True)
        if kq is not None and vq is not None:
            vqt = vq[:, a:b].float().masked_fill(~valid[a:b][None, :, None], 0.0)
            pv = torch.matmul(p * own, vt) + torch.matmul(p * ~own, vqt)
        else:
            pv = torch.matmul(p, vt)
        acc = acc * alpha + pv
        m = m_new
    return (acc / torch.where(l > 0, l, 1.0)).to(rows.dtype)
