"""The int4 format's block lifecycle in torch (the CPU path and the oracle for the Triton kernels).

Layout in nanokv.kv.cache; staging in nanokv.kv.staging. Three operations:
  store             this step's K/V rows go to their blocks' staging slots, in full precision;
  gather            a block reads from staging while it is open, else dequantized from the pool;
  quantize_filled   after attention: every block this step filled is quantized once from staging,
                    K per channel over the block's tokens, V per token (already rotated).
"""

from __future__ import annotations

import torch

from nanokv.kv import quant
from nanokv.kv.cache import LayerKVCache


def _parts(cache: LayerKVCache) -> tuple[torch.Tensor, ...]:
    assert cache.stage is not None and cache.k_stage is not None and cache.v_stage is not None
    assert cache.k_scale is not None and cache.k_zero is not None
    assert cache.v_scale is not None and cache.v_zero is not None
    return cache.k_stage, cache.v_stage, cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero


def store(cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> None:
    """k, v [T, H, D]; blk, off [T] int64: block id and offset of each row (all stored)."""
    k_stage, v_stage = _parts(cache)[:2]
    assert cache.stage is not None
    st = cache.stage.stage_of[blk].long()  # [T]
    if bool((st < 0).any()):
        raise RuntimeError("int4 store into a block without a staging slot: StageTable.plan() was not "
                           "called with this step's slot_mapping")
    k_stage[st, :, off] = k.to(k_stage.dtype)
    v_stage[st, :, off] = v.to(v_stage.dtype)


def gather(cache: LayerKVCache, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: [..., nb] block ids (>= 0) -> K, V [..., nb, H, bs, D]: staged blocks in full precision."""
    k_stage, v_stage, ks, kz, vs, vz = _parts(cache)
    k = quant.dequantize_int4_channels(cache.k[ids], ks[ids], kz[ids], dtype)
    v = quant.dequantize_int4(cache.v[ids], vs[ids], vz[ids], dtype)
    assert cache.stage is not None
    cache.stage.flush()  # read between steps (re-formatting): the runner's deferred map updates first
    st = cache.stage.stage_of[ids].long()  # [..., nb]
    staged = st >= 0
    if bool(staged.any()):
        sel = staged[..., None, None, None]
        k = torch.where(sel, k_stage[st.clamp_min(0)].to(dtype), k)
        v = torch.where(sel, v_stage[st.clamp_min(0)].to(dtype), v)
    return k, v


def quantize_filled(cache: LayerKVCache, layer: int = 0) -> None:
    """After the step's attention: quantize the blocks whose last slot this step wrote (once)."""
    assert cache.stage is not None
    blocks, slots = cache.stage.fill_blocks, cache.stage.fill_slots  # [F] int64 each
    if blocks.numel() == 0:
        return
    k_stage, v_stage, ks, kz, vs, vz = _parts(cache)
    kb, vb = k_stage[slots], v_stage[slots]  # [F, H, bs, D]
    if cache.monitor is not None:  # the error of exactly what is quantized (nanokv.kv.monitor)
        cache.monitor.record_blocks(layer, kb, vb)
    kc, s, z = quant.quantize_int4_channels(kb)  # [F, H, bs, D/2], [F, H, D] x2
    cache.k[blocks], ks[blocks], kz[blocks] = kc, s, z
    vc, s, z = quant.quantize_int4(vb)  # [F, H, bs, D/2], [F, H, bs] x2
    cache.v[blocks], vs[blocks], vz[blocks] = vc, s, z


def write_blocks(cache: LayerKVCache, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Whole blocks at once (re-formatting a layer to int4): ids [n]; k, v [n, H, bs, D] full
    precision. Blocks the staging table holds open go to staging, the others are quantized."""
    k_stage, v_stage, ks, kz, vs, vz = _parts(cache)
    assert cache.stage is not None
    cache.stage.flush()  # between steps: the runner's deferred map updates first
    st = cache.stage.stage_of[ids].long()
    open_ = st >= 0
    k_stage[st[open_]], v_stage[st[open_]] = k[open_].to(k_stage.dtype), v[open_].to(v_stage.dtype)
    full = ids[~open_]
    kc, s, z = quant.quantize_int4_channels(k[~open_])
    cache.k[full], ks[full], kz[full] = kc, s, z
    vc, s, z = quant.quantize_int4(v[~open_])
    cache.v[full], vs[full], vz[full] = vc, s, z
