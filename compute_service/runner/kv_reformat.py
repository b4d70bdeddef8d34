"""Re-format one layer's paged KV tensors to another bit width, block ids unchanged.

Why a whole-layer re-format and not a per-block format tag: with one format per layer the store and
attention paths (torch reference and every Triton kernel) stay exactly as they are - they dispatch
on the layer's format type (nanokv.kv.cache) at each call - so there is no per-block branch in the
hot loop and nothing to teach the kernels. The price is paid once per switch: every block of the layer is converted.

* Widening (4 -> 8 -> 16) keeps every cached block's values: int8 codes x fp16 scale are exact in
  float32 (18 significant bits); into bfloat16 they are rounded to 8 bits (~0.2 % relative, below
  int8's own error); int4 -> int8 re-quantizes the dequantized int4 values (adds int8 error, ~0.5 %).
* Narrowing (16 -> 8 -> 4) re-quantizes every cached block, including those written while the layer
  was backed off; that is why the rule narrows only after a long quiet spell.
* Memory: the old and new tensors coexist during the conversion, plus a float32 scratch of
  ``chunk`` blocks; afterwards the layer takes bytes_per_block(new bits) per block.
The key rotation flag is carried over: cached keys were stored in that basis. int4 stores values
rotated (v R), so values are rotated into / out of that basis when a layer enters / leaves int4
(unless the model's weights hold that rotation: then values stay in its basis at every width);
blocks still open (staged) stay in full precision, the others are quantized once as whole blocks.
The layer's run-time hooks (nanokv.compute_service.kv_hooks.LayerHooks) are the runner's and stay.
"""

from __future__ import annotations

import torch

from nanokv.kernels import reference
from nanokv.kv import blockquant
from nanokv.kv.cache import Int4KV, LayerKV, allocate_layer_cache
from nanokv.kv.rotation import rotation_matrix
from nanokv.kv.staging import StageTable

CHUNK_BLOCKS = 256


@torch.no_grad()
def reformat_layer(cache: LayerKV, bits: int, dtype: torch.dtype, chunk: int = CHUNK_BLOCKS,
                   stage: StageTable | None = None, values_in_weights: bool = False) -> LayerKV:
    """A new layer at ``bits`` holding ``cache``'s blocks (dtype: the 16-bit storage dtype).
    stage: the runner's int4 staging table (needed to narrow to 4 bits: open blocks stay staged).
    values_in_weights: the model's weights rotate this layer's values (LayerHooks.rotate_v_in_weights)."""
    if stage is None and isinstance(cache, Int4KV):
        stage = cache.stage
    if bits == 4 and stage is None:
        raise ValueError("re-formatting to int4 needs the runner's staging table")
    N, H, bs, D = cache.num_blocks, cache.num_kv_heads, cache.block_size, cache.head_dim
    dev = cache.k.device
    new = allocate_layer_cache(bits, N, H, bs, D, dtype, dev, rotate=cache.rotate, stage=stage)
    offsets = torch.arange(bs, device=dev)
    for start in range(0, N, chunk):
        ids = torch.arange(start, min(N, start + chunk), device=dev)
        k, v = reference.gather_kv(cache, ids, torch.float32)  # [n, H, bs, D]
        if cache.rotate_v != new.rotate_v and not values_in_weights:  # int4 keeps values rotated (v R)
            r = rotation_matrix(D, torch.float32, dev)
            v = v @ r if new.rotate_v else v @ r.T
        if isinstance(new, Int4KV):  # int4: whole blocks, quantized once (open blocks stay staged)
            blockquant.write_blocks(new, ids, k, v)
            continue
        # back to the store's row layout: [n * bs, H, D] with one slot per row
        rows_k = k.permute(0, 2, 1, 3).reshape(-1, H, D)
        rows_v = v.permute(0, 2, 1, 3).reshape(-1, H, D)
        slots = (ids[:, None] * bs + offsets[None, :]).reshape(-1)
        reference.store_kvcache(rows_k, rows_v, new, slots)
    return new
