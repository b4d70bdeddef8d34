"""Resize one layer's paged KV tensors to another block count, in place, block ids unchanged.

Every per-block tensor of the format (k, v [N, H, bs, D or D/2]; scales and zero points [N, H, bs])
is reallocated with the new leading dimension N' (and the same memory layout: int8 values are
dims-major, nanokv.kv.cache) and the first min(N, N') blocks are copied over.
Blocks [N, N') of a grown cache are zero; a shrunk cache loses blocks [N', N), which the cache
manager has already removed (none of them was referenced).

The LayerKVCache object itself stays (its fields are replaced): the runner's list, the compression
monitor, the error probe and hybrid sparsity's demotion store keep pointing at it (its slots are not
block ids, so `demoted` keeps its size). Captured CUDA graphs do not: they hold the old tensors'
addresses and must be captured again.
Memory: one layer's old and new tensors coexist during its copy, then the old ones are dropped.
"""

from __future__ import annotations

import torch

from nanokv.kv.cache import LayerKVCache, block_tensor, is_transposed

BLOCK_FIELDS = ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero")


@torch.no_grad()
def resize_layer_cache(cache: LayerKVCache, num_blocks: int) -> None:
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    keep = min(cache.num_blocks, num_blocks)
    for name in BLOCK_FIELDS:
        old = getattr(cache, name)
        if old is None:
            continue
        new = block_tensor((num_blocks, *old.shape[1:]), old.dtype, old.device, is_transposed(old))
        new[:keep].copy_(old[:keep])
        setattr(cache, name, new)
        del old  # the last reference: on CUDA the caching allocator may reuse it for the next field
