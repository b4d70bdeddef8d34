"""Whole KV blocks between the device pool's format and a narrower lower-tier format (int8, int4).

A lower tier (the host tier, and the disk and shared tiers that store its bytes as they are) may
keep blocks in the int8 or int4 format of nanokv.kv.cache while the device pool (L1) is 16-bit:
`CacheConfig.cpu_offload_kv_format`. A block written down is quantized from L1's format into the
tier's (`encode`); a block loaded back is dequantized into L1's (`decode`, then `write_blocks`).
The quantizers are nanokv.kv.quant's, the very ones of the pool formats:
  int8  keys rotated (nanokv.kv.rotation), symmetric per (token, head); values per (token, head)
  int4  keys rotated, per channel over the block's tokens (KIVI); values rotated (v R), per token
so a tier block is a valid block of that format (its layer's default basis) whatever L1 is: the
host segment is carved with nanokv.kv.segment like any pool, and an int8 L1 with a same-format
tier stores the same bytes. Rotations are orthonormal: only the quantization error is added.

Shapes: ids [n] block ids; k, v [n, H, bs, D] float32 in the source layer's basis; encoded fields
[n, ...] as the format's block_fields (nanokv.kv.cache).
"""

from __future__ import annotations

import torch

from nanokv.kv import quant
from nanokv.kv.cache import FullKV, Int8KV, LayerKV
from nanokv.kv.rotation import rotates, rotation_matrix

# cpu_offload_kv_format -> the tier's bit width (None: the pool's own format, bytes copied as they are)
TIER_FORMAT_BITS: dict[str, int | None] = {"pool": None, "int8": 8, "int4": 4}


def tier_layer_bits(layer_bits: list[int], tier_format: str) -> list[int]:
    """Each layer's bit width in the tier: the pool's, or the tier format's where that is narrower."""
    bits = TIER_FORMAT_BITS[tier_format]
    return list(layer_bits) if bits is None else [min(b, bits) for b in layer_bits]


def basis(cache: LayerKV) -> tuple[bool, bool]:
    """(keys rotated, values rotated): the basis a layer stores K and V in."""
    return cache.rotate, cache.rotate_v


def tier_basis(bits: int) -> tuple[bool, bool]:
    """The basis of a tier block of this format: the format's default (as a pool layer of it)."""
    return rotates(bits), bits == 4


def same_format(dev: LayerKV, host: LayerKV) -> bool:
    """Blocks copy as bytes between layers of one format (in the device layer's basis: they only
    ever come back to a pool of the same settings, whose disk and shared-tier fingerprint says so)."""
    return type(dev) is type(host)


def _rotate(x: torch.Tensor, src: bool, dst: bool) -> torch.Tensor:
    """x [..., D] float32 from one basis (rotated by R or not) to the other."""
    if src == dst:
        return x
    r = rotation_matrix(x.shape[-1], torch.float32, x.device)
    return x @ r if dst else x @ r.T


def read_blocks(cache: LayerKV, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of whole blocks [n, H, bs, D] float32, in the layer's basis (16- and 8-bit layers)."""
    if isinstance(cache, Int8KV):
        return (quant.dequantize_int8(cache.k[ids], cache.k_scale[ids], torch.float32),
                quant.dequantize_int8(cache.v[ids], cache.v_scale[ids], torch.float32))
    if isinstance(cache, FullKV):
        return cache.k[ids].float(), cache.v[ids].float()
    raise ValueError(f"a {cache.bits}-bit layer keeps open blocks in staging: not read as whole blocks here")


def write_blocks(cache: LayerKV, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Whole blocks into a 16- or 8-bit layer: k, v [n, H, bs, D] float32 in the layer's basis."""
    if isinstance(cache, Int8KV):
        for codes_t, scale_t, x in ((cache.k, cache.k_scale, k), (cache.v, cache.v_scale, v)):
            codes, scale = quant.quantize_int8(x)
            codes_t.index_copy_(0, ids, codes)
            scale_t.index_copy_(0, ids, scale)
    elif isinstance(cache, FullKV):
        cache.k.index_copy_(0, ids, k.to(cache.k.dtype))
        cache.v.index_copy_(0, ids, v.to(cache.v.dtype))
    else:
        raise ValueError(f"a {cache.bits}-bit layer keeps open blocks in staging: not written as whole blocks here")


def encode(k: torch.Tensor, v: torch.Tensor, src: tuple[bool, bool], bits: int) -> dict[str, torch.Tensor]:
    """k, v [n, H, bs, D] float32 in basis `src` -> the tier format's block fields, [n, ...] each."""
    rk, rv = tier_basis(bits)
    k = _rotate(k, src[0], rk)
    v = _rotate(v, src[1], rv)
    if bits == 8:
        kc, ks = quant.quantize_int8(k)
        vc, vs = quant.quantize_int8(v)
        return {"k": kc, "v": vc, "k_scale": ks, "v_scale": vs}
    if bits == 4:
        kc, ks, kz = quant.quantize_int4_channels(k)  # [n, H, bs, D/2], [n, H, D] x2
        vc, vs, vz = quant.quantize_int4(v)  # [n, H, bs, D/2], [n, H, bs] x2
        return {"k": kc, "v": vc, "k_scale": ks, "k_zero": kz, "v_scale": vs, "v_zero": vz}
    raise ValueError(f"a lower tier stores int8 or int4, not {bits}-bit blocks")


def decode(fields: dict[str, torch.Tensor], bits: int, dst: tuple[bool, bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """A tier format's block fields [n, ...] -> k, v [n, H, bs, D] float32 in basis `dst`."""
    f = fields
    if bits == 8:
        k = quant.dequantize_int8(f["k"], f["k_scale"], torch.float32)
        v = quant.dequantize_int8(f["v"], f["v_scale"], torch.float32)
    elif bits == 4:
        k = quant.dequantize_int4_channels(f["k"], f["k_scale"], f["k_zero"], torch.float32)
        v = quant.dequantize_int4(f["v"], f["v_scale"], f["v_zero"], torch.float32)
    else:
        raise ValueError(f"a lower tier stores int8 or int4, not {bits}-bit blocks")
    rk, rv = tier_basis(bits)
    return _rotate(k, rk, dst[0]), _rotate(v, rv, dst[1])


@torch.no_grad()
def round_trip(cache: LayerKV, ids: torch.Tensor, bits: int) -> None:
    """Blocks `ids` of a 16- or 8-bit layer as a load from a `bits` tier leaves them: written down
    into that format and read back, in place (what serving does to a block that went through a
    lower tier; nanokv eval --lower-tier-format measures it)."""
    k, v = read_blocks(cache, ids)
    k, v = decode(encode(k, v, basis(cache), bits), bits, basis(cache))
    write_blocks(cache, ids, k, v)
