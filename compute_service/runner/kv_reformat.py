"""Re-format one layer's paged KV tensors to another bit width, block ids unchanged.

Why a whole-layer re-format and not a per-block format tag: with one format per layer the store and
attention paths (torch reference and every Triton kernel) stay exactly as they are - they dispatch
on ``cache.bits`` at each call - so there is no per-block branch in the hot loop and nothing to
teach the kernels. The price is paid once per switch: every block of the layer is converted.

* Widening (4 -> 8 -> 16) keeps every cached block's values: int8 codes x fp16 scale are exact in
  float32 (18 significant bits); into bfloat16 they are rounded to 8 bits (~0.2 % relative, below
  int8's own error); int4 -> int8 re-quantizes the dequantized int4 values (adds int8 error, ~0.5 %).
* Narrowing (16 -> 8 -> 4) re-quantizes every cached block, including those written while the layer
  was backed off; that is why the rule narrows only after a long quiet spell.
* Memory: the old and new tensors coexist during the conversion, plus a float32 scratch of
  ``chunk`` blocks; afterwards the layer takes bytes_per_block(new bits) per block.
The key rotation flag is carried over: cached keys were stored in that basis. int4 stores values
rotated (v R), so values are rotated into / out of that basis when a layer enters / leaves int4;
blocks still open (staged) stay in full precision, the others are quantized once as whole blocks.
"""

from __future__ import annotations

import torch

from nanokv.kernels import reference
from nanokv.kv import blockquant
from nanokv.kv.cache import LayerKVCache, allocate_layer_cache
from nanokv.kv.rotation import rotation_matrix
from nanokv.kv.staging import StageTable

CHUNK_BLOCKS = 256


@torch.no_grad()
def reformat_layer(cache: LayerKVCache, bits: int, dtype: torch.dtype, chunk: int = CHUNK_BLOCKS,
                   stage: StageTable | None = None) -> LayerKVCache:
    """A new LayerKVCache at ``bits`` holding ``cache``'s blocks (dtype: the 16-bit storage dtype).
    stage: the runner's int4 staging table (needed to narrow to 4 bits: open blocks stay staged)."""
    if bits == 4 and stage is None and cache.stage is None:
        raise ValueError("re-formatting to int4 needs the runner's staging table")
    N, H, bs, D = cache.num_blocks, cache.num_kv_heads, cache.block_size, int(cache.v.shape[-1])
    if cache.bits == 4:
        D = 2 * D  # packed: two values per byte
    dev = cache.k.device
    new = allocate_layer_cache(bits, N, H, bs, D, dtype, dev, rotate=cache.rotate, stage=stage or cache.stage)
    new.monitor, new.fake_quant = cache.monitor, cache.fake_quant
    new.probe = cache.probe
    new.rotate_v_in_weights = cache.rotate_v_in_weights  # (then values stay in the weights' basis)
    offsets = torch.arange(bs, device=dev)
    for start in range(0, N, chunk):
        ids = torch.arange(start, min(N, start + chunk), device=dev)
        k, v = reference.gather_kv(cache, ids, torch.float32)  # [n, H, bs, D]
        if cache.rotate_v != new.rotate_v and not cache.rotate_v_in_weights:  # int4 keeps values rotated (v R)
            r = rotation_matrix(D, torch.float32, dev)
            v = v @ r if new.rotate_v else v @ r.T
        if new.stage is not None:  # int4: whole blocks, quantized once (open blocks stay staged)
            blockquant.write_blocks(new, ids, k, v)
            continue
        # back to the store's row layout: [n * bs, H, D] with one slot per row
        rows_k = k.permute(0, 2, 1, 3).reshape(-1, H, D)
        rows_v = v.permute(0, 2, 1, 3).reshape(-1, H, D)
        slots = (ids[:, None] * bs + offsets[None, :]).reshape(-1)
        reference.store_kvcache(rows_k, rows_v, new, slots)
    return new
