"""Torch reference for the paged-KV kernels: the CPU path and the oracle for Triton.

Contract (shared with nanokv.kernels.triton_*):
  store_kvcache(k, v, cache, slot_mapping)      k, v: [T, H, D]; slot_mapping: [T] int64, -1 = skip
  paged_attention(q, cache, md, scale) -> out   q: [T, Hq, D] -> out: [T, Hq, D]
New tokens are stored first, then every query reads its whole context from the paged cache,
so prefill chunks, prefix hits and decodes all take the same path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanokv.kernels import cpu_attention
from nanokv.kv import blockquant, quant
from nanokv.kv.cache import FullKV, Int8KV, LayerKV
from nanokv.kv.demote import HybridInt8KV
from nanokv.kv.metadata import AttentionMetadata

SMALL_STORE = 4  # tokens: up to this many, a CPU step stores each by plain views (decode steps)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slot_mapping: torch.Tensor) -> None:
    if k.shape[0] <= SMALL_STORE and type(cache) is FullKV and k.device.type == "cpu":
        # a decode step: two view copies per token instead of ~10 ops of advanced indexing (~100 us a
        # layer, a tenth of a one-stream decode step on the CPU); the same values land in the same slots
        bs = cache.block_size
        for t, s in enumerate(slot_mapping.tolist()):
            if s >= 0:
                cache.k[s // bs, :, s % bs].copy_(k[t])
                cache.v[s // bs, :, s % bs].copy_(v[t])
        return
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    if slot_mapping.numel() == 0:
        return
    bs = cache.block_size
    blk = slot_mapping // bs
    off = slot_mapping % bs
    if isinstance(cache, FullKV):
        cache.k[blk, :, off] = k.to(cache.k.dtype)
        cache.v[blk, :, off] = v.to(cache.v.dtype)
    elif isinstance(cache, Int8KV):
        kc, ks = quant.quantize_int8(k)
        vc, vs = quant.quantize_int8(v)
        cache.k[blk, :, off], cache.v[blk, :, off] = kc, vc
        cache.k_scale[blk, :, off], cache.v_scale[blk, :, off] = ks, vs
    else:  # int4: full precision into staging; quantized when the block fills
        blockquant.store(cache, k, v, blk, off)


def gather_kv(cache: LayerKV, block_ids: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """block_ids: [..., nb] -> K, V [..., nb, H, bs, D]. Entries >= 0 are pool blocks; holes (-1) read
    block 0 (callers mask them); entries <= -2 (int8 layers under hybrid sparsity) are slots of the
    layer's INT4 demotion store (nanokv.kv.demote)."""
    ids = block_ids.clamp_min(0).long()
    if isinstance(cache, FullKV):
        return cache.k[ids].to(dtype), cache.v[ids].to(dtype)
    if isinstance(cache, Int8KV):
        k = quant.dequantize_int8(cache.k[ids], cache.k_scale[ids], dtype)
        v = quant.dequantize_int8(cache.v[ids], cache.v_scale[ids], dtype)
        if isinstance(cache, HybridInt8KV):  # hybrid sparsity: entries <= -2 read the demotion store instead
            cache.demoted.overwrite(block_ids, k, v)
        return k, v
    return blockquant.gather(cache, ids, dtype)


def gather_kv_heads(cache: LayerKV, block_ids: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """block_ids: [B, nb] -> K, V [B, H, nb*bs, D], what SDPA takes.

    16-bit caches gather through the head-major view [H, N, bs, D] of the cache: the result is
    [H, B, nb, bs, D] contiguous, so moving H after B and merging (nb, bs) are free views and the
    context is copied once (gathering [B, nb, H, bs, D] and permuting would copy it twice; on the
    CPU that second copy cost as much as all the model's matmuls in a decode step).
    """
    B, nb = block_ids.shape
    H, bs = cache.num_kv_heads, cache.block_size
    if isinstance(cache, FullKV) and dtype == cache.k.dtype:
        ids = block_ids.clamp_min(0).long()
        k = cache.k.transpose(0, 1)[:, ids].transpose(0, 1)  # [B, H, nb, bs, D]
        v = cache.v.transpose(0, 1)[:, ids].transpose(0, 1)
        return k.reshape(B, H, nb * bs, -1), v.reshape(B, H, nb * bs, -1)
    k, v = gather_kv(cache, block_ids, dtype)  # [B, nb, H, bs, D]
    D = k.shape[-1]
    return (k.permute(0, 2, 1, 3, 4).reshape(B, H, nb * bs, D),
            v.permute(0, 2, 1, 3, 4).reshape(B, H, nb * bs, D))


def _key_valid(block_ids: torch.Tensor, bs: int, seq_len: torch.Tensor) -> torch.Tensor:
    """block_ids: [B, nb]; seq_len: [B] -> bool [B, nb*bs]: key exists (not a hole, < seq_len).
    Only -1 is a hole: entries <= -2 are demoted blocks (nanokv.kv.demote), real keys."""
    B, nb = block_ids.shape
    pos = torch.arange(nb * bs, device=block_ids.device)
    valid = pos.unsqueeze(0) < seq_len.unsqueeze(1)
    not_hole = (block_ids != -1).repeat_interleave(bs, dim=1)
    return valid & not_hole


def paged_attention(q: torch.Tensor, cache: LayerKV, md: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    if cpu_attention.applies(q, cache):
        plan = cpu_attention.step_plan(md, cache.block_size)
        if plan is not None:  # no holes: exact-length contexts, fused SDPA (nanokv.kernels.cpu_attention)
            return cpu_attention.paged_attention(q, cache, md, scale, plan)
    T, Hq, D = q.shape
    H = cache.num_kv_heads
    bs = cache.block_size
    out = torch.empty_like(q)
    # prefills (and prefill chunks): one causal SDPA per sequence over its gathered context
    for i in range(md.num_prefills):
        s, e = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        L = md.seq_lens_cpu[i]
        nb = (L + bs - 1) // bs
        ids = md.block_tables[i, :nb]
        k, v = gather_kv_heads(cache, ids.unsqueeze(0), q.dtype)  # [1, H, nb*bs, D]
        k, v = k[0, :, :L], v[0, :, :L]
        qlen = e - s
        qpos = torch.arange(L - qlen, L, device=q.device)
        mask = qpos.unsqueeze(1) >= torch.arange(L, device=q.device).unsqueeze(0)  # [qlen, L]
        mask &= _key_valid(ids.unsqueeze(0), bs, torch.tensor([L], device=q.device))[:, :L]
        qi = q[s:e].transpose(0, 1)  # [Hq, qlen, D]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=Hq != H)
        out[s:e] = o.transpose(0, 1)
    # decodes: all at once, batched over sequences
    nd = md.num_seqs - md.num_prefills
    if nd:
        s0 = md.num_prefill_tokens
        seq_lens = md.seq_lens[md.num_prefills:]
        nb = (max(md.seq_lens_cpu[md.num_prefills:]) + bs - 1) // bs
        ids = md.block_tables[md.num_prefills:, :nb]  # [nd, nb]
        k, v = gather_kv_heads(cache, ids, q.dtype)  # [nd, H, nb*bs, D]
        mask = _key_valid(ids, bs, seq_lens)[:, None, None, :]  # [nd, 1, 1, nb*bs]
        qd = q[s0:s0 + nd].unsqueeze(2)  # [nd, Hq, 1, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale, enable_gqa=Hq != H)
        out[s0:s0 + nd] = o.squeeze(2)
    return out
