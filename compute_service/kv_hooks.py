"""The KV layer's hooks into the model: `before_store`, called by the attention layer on q/k/v
right before the backend stores K/V, on every backend (torch reference and Triton alike); before it,
`qk_dtype`, the dtype the layer's format wants q and k in (asked before RoPE, which writes it).

In order:
  1. test hook: scaled key channels in one layer (`key_outliers`), with the query channels scaled
     inversely so that full-precision scores are unchanged and only quantization feels them;
  2. the layer format's rotation of q and k (nanokv.kv.rotation), when the cache has `rotate`;
  3. measurement only: a FakeQuant simulating another format on a 16-bit cache;
  4. the compression monitor's sampled error of exactly the rows about to be stored;
  5. the adaptive controller's error probe (nanokv.compute_service.error_probe), which also needs q;
  6. sparsity: feed the step's attention probe when the runner set one (md.extras["attn_probe"],
     nanokv.compute_service.sparsity.probe).
int4 layers also rotate v (the format stores v R), unless the model's weights already do
(LayerKVCache.rotate_v_in_weights). `after_attention` is the matching hook after the step's
attention: int4 blocks filled by the step are quantized there (unless the decode kernel did,
LayerKVCache.filled_in_step), and the output rotated back.
Layers without any of these pay one attribute check each.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from nanokv.kv.blockquant import quantize_filled
from nanokv.kv.cache import LayerKVCache
from nanokv.kv.rotation import maybe_rotate, rotation_matrix

# layer -> (channels, factor): test hook state, process-wide (see key_outliers)
_OUTLIERS: dict[int, tuple[tuple[int, ...], float]] = {}


def set_key_outliers(layer: int, factor: float = 30.0, channels: Sequence[int] = (0, 1)) -> None:
    """Test hook: make `layer` produce outlier keys (k[..., c] *= factor, q[..., c] /= factor)."""
    _OUTLIERS[layer] = (tuple(int(c) for c in channels), float(factor))


def clear_key_outliers() -> None:
    _OUTLIERS.clear()


@contextmanager
def key_outliers(layer: int, factor: float = 30.0, channels: Sequence[int] = (0, 1)) -> Iterator[None]:
    set_key_outliers(layer, factor, channels)
    try:
        yield
    finally:
        _OUTLIERS.pop(layer, None)


def _step_positions(md: Any, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token positions [T] and sequence index [T] of this step's packed tokens (from host metadata)."""
    pos: list[int] = []
    seq: list[int] = []
    qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
    for i in range(len(lens)):
        n = qsl[i + 1] - qsl[i]
        pos.extend(range(lens[i] - n, lens[i]))
        seq.extend([i] * n)
    if len(pos) != T:
        raise RuntimeError(f"metadata covers {len(pos)} tokens, the step has {T}")
    return torch.tensor(pos, device=device), torch.tensor(seq, device=device)


def _capturing(x: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured: the monitor syncs, so it only samples eager steps
    (prefills and any decode step run outside a graph)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def qk_dtype(cache: LayerKVCache, x: torch.Tensor) -> torch.dtype:
    """The dtype q and k should reach before_store in, for activations x: fp16 for an int8 layer of a
    bf16 model on a GPU, else x's. The int8 kernels compute in fp16, and fresh prompts attend through
    fp16 flash on the codes read back (nanokv.kernels.fresh_prefill): a bf16 q was cast for every
    prefill (0.075 s of the H200 long-context run), while the model's RoPE kernel writes fp16 for
    free. fp16 holds every bf16 value of the range the kernels already assume (they read q, and
    dequantize keys, in fp16); the key rotation and the store then run on fp16 q and k."""
    if cache.bits == 8 and x.is_cuda and x.dtype == torch.bfloat16:
        return torch.float16
    return x.dtype


def fused_rotation(layer: int, cache: LayerKVCache, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """R [D, D] in dtype when this layer's format rotates q and k (step 2 below) and the model's RoPE
    kernel may apply it instead (before_store is then told `rotated`); None otherwise, and while the
    outlier test hook, which must act before the rotation, is set for the layer."""
    if not cache.rotate or (_OUTLIERS and layer in _OUTLIERS):
        return None
    return rotation_matrix(x.shape[-1], dtype, x.device)


def before_store(layer: int, cache: LayerKVCache, md: Any, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hk, D] (post-RoPE) -> (q, k, v) to hand to store + attention.
    rotated: q and k arrive already rotated (fused_rotation)."""
    if _OUTLIERS and layer in _OUTLIERS:
        channels, factor = _OUTLIERS[layer]
        k, q = k.clone(), q.clone()
        k[..., list(channels)] *= factor
        q[..., list(channels)] /= factor
    if cache.rotate and not rotated:
        q, k = maybe_rotate(q, k, cache.bits, rotate=True)
    if cache.rotate_v and not cache.rotate_v_in_weights:  # int4 values are stored as v R (the output
        v = v @ rotation_matrix(v.shape[-1], v.dtype, v.device)  # is rotated back in after_attention)
    if cache.fake_quant is not None:
        pos, seq = _step_positions(md, k.shape[0], k.device)
        k, v = cache.fake_quant.apply(k, v, pos, seq, cache.block_size)
    if cache.monitor is not None and cache.stage is None and not _capturing(k):
        cache.monitor.maybe_record(layer, cache.bits, k, v, cache.k.dtype if cache.bits >= 16 else k.dtype)
    if cache.probe is not None and not _capturing(k):
        cache.probe(layer, q, k, v)
    attn_probe = md.extras.get("attn_probe") if getattr(md, "extras", None) else None
    if attn_probe is not None:  # sparsity (attention/hybrid): attention mass per block, sparsity.probe
        attn_probe.record(layer, cache, md, q, k)
    return q, k, v


def _monitor_fill(layer: int, cache: LayerKVCache) -> None:
    """The quality monitor's sample of an int4 fill (eager steps): the first block this step fills,
    read from staging before it is freed (record_blocks samples one call in `every` itself)."""
    assert cache.stage is not None and cache.k_stage is not None and cache.v_stage is not None
    first = cache.stage.first_fill()
    if first is not None:
        cache.monitor.record_blocks(layer, cache.k_stage[first:first + 1], cache.v_stage[first:first + 1])


def after_attention(layer: int, cache: LayerKVCache, md: Any, o: torch.Tensor) -> torch.Tensor:
    """o [T, Hq, D]: the step's attention output -> the same in the model's basis. Called by the
    attention layer after attention: int4 quantizes the blocks this step filled (once, from staging)
    and rotates the output back (values are stored rotated); a simulated quantize-on-fill format
    (FakeQuant.on_fill) quantizes its filled blocks in place."""
    if cache.stage is not None:
        if cache.k.is_cuda:
            # one Triton kernel finds the filled blocks on the device (no host list, no copy, no sync;
            # bit for bit the torch quantize_filled): in captured decode steps from the step's slot
            # mapping; in eager steps from the filled blocks' last slots (the runner's, in the
            # step's one upload): one program per filled block, not per step token (a 16k-token
            # prefill chunk launched 262k programs per layer, 15 of 16 with nothing to do)
            from nanokv.kernels.triton_blockquant import prefill_fill_warps, quantize_filled_graphsafe
            if cache.monitor is not None and not _capturing(o):
                _monitor_fill(layer, cache)
            if cache.filled_in_step:  # the decode kernel quantized them (cuda_decode_int4)
                cache.filled_in_step = False
            else:
                fill = md.extras.get("fill_slots")  # prefill steps: one program per filled block
                quantize_filled_graphsafe(cache, md.slot_mapping if fill is None else fill,
                                          0 if fill is None else prefill_fill_warps())
        else:
            quantize_filled(cache, layer)
    if cache.rotate_v and not cache.rotate_v_in_weights:
        o = o @ rotation_matrix(o.shape[-1], o.dtype, o.device).T
    fq = cache.fake_quant
    if fq is not None and fq.on_fill:
        pos, _ = _step_positions(md, int(md.slot_mapping.shape[0]), md.slot_mapping.device)
        fq.fill_blocks(cache.k, cache.v, md.slot_mapping, pos)
    return o
