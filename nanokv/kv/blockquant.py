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
from nanokv.kv.cache import Int4KV


def store(cache: Int4KV, k: torch.Tensor, v: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> None:
    """k, v [T, H, D]; blk, off [T] int64: block id and offset of each row (all stored)."""
    st = cache.stage.stage_of[blk].long()  # [T]
    if bool((st < 0).any()):
        raise RuntimeError("int4 store into a block without a staging slot: StageTable.plan() was not "
                           "called with this step's slot_mapping")
    cache.k_stage[st, :, off] = k.to(cache.k_stage.dtype)
    cache.v_stage[st, :, off] = v.to(cache.v_stage.dtype)


def gather(cache: Int4KV, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """ids: [..., nb] block ids (>= 0) -> K, V [..., nb, H, bs, D]: staged blocks in full precision."""
    k = quant.dequantize_int4_channels(cache.k[ids], cache.k_scale[ids], cache.k_zero[ids], dtype)
    v = quant.dequantize_int4(cache.v[ids], cache.v_scale[ids], cache.v_zero[ids], dtype)
    cache.stage.flush()  # read between steps (re-formatting): the runner's deferred map updates first
    st = cache.stage.stage_of[ids].long()  # [..., nb]
    staged = st >= 0
    if bool(staged.any()):
        sel = staged[..., None, None, None]
        k = torch.where(sel, cache.k_stage[st.clamp_min(0)].to(dtype), k)
        v = torch.where(sel, cache.v_stage[st.clamp_min(0)].to(dtype), v)
    return k, v


def first_filled(cache: Int4KV) -> tuple[torch.Tensor, torch.Tensor] | None:
    """K, V [1, H, bs, D] from staging of the first block this step fills (host bookkeeping, no
    sync), None if it fills none: the compression monitor's sample of a fill (nanokv.kv.monitor
    record_blocks). Staging keeps the block until the step ends, before or after its quantization."""
    first = cache.stage.first_fill()
    if first is None:
        return None
    return cache.k_stage[first:first + 1], cache.v_stage[first:first + 1]


def quantize_filled(cache: Int4KV) -> None:
    """After the step's attention: quantize the blocks whose last slot this step wrote (once)."""
    blocks, slots = cache.stage.fill_blocks, cache.stage.fill_slots  # [F] int64 each
    if blocks.numel() == 0:
        return
    kb, vb = cache.k_stage[slots], cache.v_stage[slots]  # [F, H, bs, D]
    kc, s, z = quant.quantize_int4_channels(kb)  # [F, H, bs, D/2], [F, H, D] x2
    cache.k[blocks], cache.k_scale[blocks], cache.k_zero[blocks] = kc, s, z
    vc, s, z = quant.quantize_int4(vb)  # [F, H, bs, D/2], [F, H, bs] x2
    cache.v[blocks], cache.v_scale[blocks], cache.v_zero[blocks] = vc, s, z


def write_blocks(cache: Int4KV, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Whole blocks at once (re-formatting a layer to int4): ids [n]; k, v [n, H, bs, D] full
    precision. Blocks the staging table holds open go to staging, the others are quantized."""
    cache.stage.flush()  # between steps: the runner's deferred map updates first
    st = cache.stage.stage_of[ids].long()
    open_ = st >= 0
    cache.k_stage[st[open_]] = k[open_].to(cache.k_stage.dtype)
    cache.v_stage[st[open_]] = v[open_].to(cache.v_stage.dtype)
    full = ids[~open_]
    kc, s, z = quant.quantize_int4_channels(k[~open_])
    cache.k[full], cache.k_scale[full], cache.k_zero[full] = kc, s, z
    vc, s, z = quant.quantize_int4(v[~open_])
    cache.v[full], cache.v_scale[full], cache.v_zero[full] = vc, s, z
