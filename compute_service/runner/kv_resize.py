"""Resize one layer's paged KV tensors to another block count, block ids unchanged.

Every per-block tensor of the format (k, v [N, H, bs, D or D/2]; scales and zero points [N, H, bs])
is reallocated with the new leading dimension N' (and the same memory layout: int8 values are
dims-major, nanokv.kv.cache) and the first min(N, N') blocks are copied over.
Blocks [N, N') of a grown cache are zero; a shrunk cache loses blocks [N', N), which the cache
manager has already removed (none of them was referenced).

The layer's KV object is frozen: the resize returns a new one of the same type (dataclasses.replace:
staging, flags and hybrid sparsity's demotion part carried over; its slots are not block ids, so
`demoted` keeps its size), which the runner puts in its list's entry. The runner's hooks for the
layer (monitor, error probe) are not on it and stay. Captured CUDA graphs hold the old tensors'
addresses and must be captured again.
Memory: one layer's old and new tensors coexist during its copy, then the old ones are dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from nanokv.kv.cache import LayerKV, block_tensor, is_transposed


@torch.no_grad()
def resize_layer_cache(cache: LayerKV, num_blocks: int) -> LayerKV:
    """`cache` with every per-block tensor (its format's block_fields) at `num_blocks` blocks."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    keep = min(cache.num_blocks, num_blocks)
    new: dict[str, Any] = {}  # field name -> its resized tensor
    for name in cache.block_fields:
        old = getattr(cache, name)
        t = block_tensor((num_blocks, *old.shape[1:]), old.dtype, old.device, is_transposed(old))
        t[:keep].copy_(old[:keep])
        new[name] = t
    return dataclasses.replace(cache, **new)
