"""Attention over the paged KV cache: the one place a layer meets AttentionMetadata.

The layer never sees sequences or blocks: it reads the per-step context (metadata, one KV format
object per layer, nanokv.kv.cache, and each layer's hooks), stores this step's K/V by slot_mapping
and attends through the backend, so prefill chunks, prefix hits and decodes all take the same path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanokv.compute_service.attention.backend import REFERENCE
from nanokv.compute_service.kv_hooks import after_attention, before_store, fused_rotation, qk_dtype
from nanokv.kv.metadata import get_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int):
        super().__init__()
        self.num_heads = num_heads  # on this rank
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx

    def qk_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype this layer's KV format wants q and k in (nanokv.compute_service.kv_hooks.qk_dtype); x: the
        model's activations (their dtype without a cache, e.g. while profiling)."""
        ctx = get_context()
        if ctx.metadata is None:
            return x.dtype
        return qk_dtype(ctx.kv_caches[self.layer_idx], x)

    def qk_rotation(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """The KV format's rotation R [D, D] for the model's RoPE kernel to apply to q and k, when the
        backend asks for that (TritonConfig.qk_rotation_in_rope) and the layer's format rotates;
        else None (the rotation then happens in before_store)."""
        ctx = get_context()
        cfg = getattr(ctx.backend, "config", None)
        if ctx.metadata is None or not getattr(cfg, "qk_rotation_in_rope", False):
            return None
        return fused_rotation(self.layer_idx, ctx.kv_caches[self.layer_idx], x, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotated: bool = False) -> torch.Tensor:
        """q [T, Hq*D], k and v [T, Hk*D] (RoPE applied; q and k may be in the attention's own dtype,
        qk_dtype, and with `rotated` already multiplied by qk_rotation's R) -> attention output
        [T, Hq*D] in v's dtype (the model's)."""
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        ctx = get_context()
        md = ctx.metadata
        if md is None:
            # profiling / warm-up: the tokens are one causal sequence and nothing is cached
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
            ).transpose(0, 1)
        else:
            cache = ctx.kv_caches[self.layer_idx]
            if len(ctx.hooks) != len(ctx.kv_caches):
                raise RuntimeError("a forward with metadata needs each layer's hooks (forward_context(hooks=...))")
            hooks = ctx.hooks[self.layer_idx]
            # KV compression (owned by nanokv.kv): Hadamard-rotate q/k when this layer's format
            # says so, sample the compression error, test hooks. Before the store, on every backend.
            q, k, v = before_store(self.layer_idx, cache, hooks, md, q, k, v, rotated)
            backend = ctx.backend or REFERENCE
            backend.store_kvcache(k, v, cache, md.slot_mapping)
            o = backend.paged_attention(q, cache, md, self.scale, k=k, v=v)
            o = after_attention(self.layer_idx, cache, hooks, md, o)
        if o.dtype != v.dtype:  # (the Triton backend already writes v's dtype)
            o = o.to(v.dtype)
        return o.reshape(T, self.num_heads * self.head_dim)
