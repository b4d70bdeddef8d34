"""INT8 blocks demoted to INT4 in place (hybrid sparsity), and the torch reference read of the mix.

An int8 layer cache (k, v: int8 [N, H, bs, D]; k_scale, v_scale: float16 [N, H, bs]) holds a
demoted block in the same slot, flagged in `cache.demoted` (bool [N], one flag per block id).
Each (token, head) row of D bytes of a demoted block holds

    bytes [0, D/2)        packed int4 codes, the nanokv.kv.quant.quantize_int4 layout
                          (dim d in the low nibble, d + D/2 in the high one)
    bytes [D/2, D/2 + 2)  the row's float16 zero point
    bytes [D/2 + 2, D)    unused

and its int4 scale replaces the int8 scale in k_scale / v_scale. The int4 codes come from the
dequantized int8 row (a second rounding on top of the int8 one; keys stay in the rotated basis).

Memory: the slot stays int8-sized. What a demoted block *needs* is exactly an int4 block
(nanokv.kv.cache.bytes_per_block(4, ...)); the eval's "peak KV bytes" counts live blocks at the
bytes of their format, which a per-format block allocator would realise (not done here).

A flag is cleared when any slot of its block is stored again (`clear_on_store`, called from
nanokv.kv.hooks.before_store): a demoted block is always full, so a new store means the block id
was freed and handed to a new owner who writes int8.
"""

from __future__ import annotations

import torch

from nanokv.kv import quant
from nanokv.kv.cache import LayerKVCache


def enable(cache: LayerKVCache) -> bool:
    """Give an int8 layer its demotion flags (all False). Other formats cannot demote: False."""
    if cache.bits != 8:
        return False
    if cache.demoted is None:
        cache.demoted = torch.zeros(cache.num_blocks, dtype=torch.bool, device=cache.k.device)
    return True


def _pack_row(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows codes [n, H, bs, D], scale [n, H, bs] -> (demoted rows int8 [n, H, bs, D], int4 scale)."""
    D = codes.shape[-1]
    x = quant.dequantize_int8(codes, scale, torch.float32)
    packed, s4, z4 = quant.quantize_int4(x)  # [n, H, bs, D/2] uint8, [n, H, bs] fp16 x2
    row = torch.zeros(codes.shape, dtype=torch.uint8, device=codes.device)
    row[..., : D // 2] = packed
    row[..., D // 2: D // 2 + 2] = z4.unsqueeze(-1).view(torch.uint8)  # fp16 -> its 2 bytes
    return row.view(torch.int8), s4


def demote(cache: LayerKVCache, block_ids: list[int]) -> list[int]:
    """Re-quantize these int8 blocks to int4 in place. Returns the ids actually demoted (already
    demoted ones are skipped). The caller guarantees no other sequence reads them."""
    if not block_ids or not enable(cache):
        return []
    assert cache.demoted is not None and cache.k_scale is not None and cache.v_scale is not None
    ids = torch.tensor(sorted(set(block_ids)), dtype=torch.long, device=cache.k.device)
    ids = ids[~cache.demoted[ids]]
    if ids.numel() == 0:
        return []
    for codes, scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        codes[ids], scale[ids] = _pack_row(codes[ids], scale[ids])
    cache.demoted[ids] = True
    return ids.tolist()


def clear_on_store(cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    """slot_mapping [T] int64 (-1 = no store): blocks written this step hold int8 again."""
    slots = slot_mapping[slot_mapping >= 0]
    if cache.demoted is not None and slots.numel():
        cache.demoted[slots // cache.block_size] = False


def _unpack(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Demoted rows codes int8 [..., D], scale [...] -> values [..., D]."""
    D = codes.shape[-1]
    u = codes.view(torch.uint8)
    zero = u[..., D // 2: D // 2 + 2].contiguous().view(torch.float16).squeeze(-1)
    return quant.dequantize_int4(u[..., : D // 2], scale, zero, dtype)


def gather_mixed(cache: LayerKVCache, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [..., nb] (valid block ids) -> K, V [..., nb, H, bs, D], each block read in its own format."""
    assert cache.demoted is not None and cache.k_scale is not None and cache.v_scale is not None
    flag = cache.demoted[ids]  # [..., nb]
    out = []
    for codes, scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        c, s = codes[ids], scale[ids]
        x = quant.dequantize_int8(c, s, dtype)
        if bool(flag.any()):
            x = torch.where(flag[..., None, None, None], _unpack(c, s, dtype), x)
        out.append(x)
    return out[0], out[1]
