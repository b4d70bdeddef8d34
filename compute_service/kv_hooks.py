"""The KV layer's hooks into the model: `before_store`, called by the attention layer on q/k/v
right before the backend stores K/V, on every backend (torch reference and Triton alike); before it,
`qk_dtype`, the dtype the layer's format wants q and k in (asked before RoPE, which writes it).

In order:
  1. test hook: scaled key channels in one layer (`key_outliers`), with the query channels scaled
     inversely so that full-precision scores are unchanged and only quantization feels them;
  2. the layer format's rotation of q and k (nanokv.kv.rotation), when the format has `rotate`;
  3. measurement only: a simulated format (nanokv.kv.fakequant.SimulatedKV) on a 16-bit cache;
  4. the compression monitor's sampled error of exactly the rows about to be stored;
  5. the adaptive controller's error probe (nanokv.compute_service.error_probe), which also needs q;
  6. sparsity: feed the step's attention probe when the runner set one (md.extras["attn_probe"],
     nanokv.compute_service.sparsity.probe).
Formats with `rotate_v` (int4) also rotate v (they store v R), unless the model's weights already
do (LayerHooks.rotate_v_in_weights). `after_attention` is the matching hook after the step's
attention: int4 blocks filled by the step are quantized there (unless the decode kernel did,
AttentionMetadata.fills_quantized), and the output rotated back.

What these hooks read besides the layer's format is its LayerHooks: the runner keeps one per layer
(ModelRunner.layer_hooks), mutable, for its whole life; a layer's KV object (nanokv.kv.cache) is
frozen and replaced by a resize, re-format or re-attach, its hooks stay.
Layers without any of these pay a few attribute checks each.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nanokv.kv.blockquant import first_filled, quantize_filled
from nanokv.kv.cache import FullKV, Int4KV, Int8KV, LayerKV
from nanokv.kv.fakequant import SimulatedKV
from nanokv.kv.metadata import AttentionMetadata
from nanokv.kv.rotation import maybe_rotate, rotation_matrix

if TYPE_CHECKING:
    from nanokv.compute_service.error_probe import ErrorProbe
    from nanokv.kv.monitor import CompressionMonitor


@dataclass(eq=False)
class LayerHooks:
    """One layer's run-time attachments (mutable; the runner's, one per layer, see the module doc)."""

    # the model's weights already make v R and take o R (KVPool.fold_value_rotations): the hooks skip
    # both GEMMs, and stored values are in that basis whatever the layer's format
    rotate_v_in_weights: bool = False
    monitor: CompressionMonitor | None = None  # samples this layer's store error (nanokv.kv.monitor)
    probe: ErrorProbe | None = None  # the adaptive width rule's: called with (layer, q, k, v) on each store


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


def qk_dtype(cache: LayerKV, x: torch.Tensor) -> torch.dtype:
    """The dtype q and k should reach before_store in, for activations x: fp16 for an int8 layer of a
    bf16 model on a GPU, else x's. The int8 kernels compute in fp16, and fresh prompts attend through
    fp16 flash on the codes read back (nanokv.kernels.fresh_prefill): a bf16 q was cast for every
    prefill (0.075 s of the H200 long-context run), while the model's RoPE kernel writes fp16 for
    free. fp16 holds every bf16 value of the range the kernels already assume (they read q, and
    dequantize keys, in fp16); the key rotation and the store then run on fp16 q and k."""
    if isinstance(cache, Int8KV) and x.is_cuda and x.dtype == torch.bfloat16:
        return torch.float16
    return x.dtype


def fused_rotation(layer: int, cache: LayerKV, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """R [D, D] in dtype when this layer's format rotates q and k (step 2 below) and the model's RoPE
    kernel may apply it instead (before_store is then told `rotated`); None otherwise, and while the
    outlier test hook, which must act before the rotation, is set for the layer."""
    if not cache.rotate or (_OUTLIERS and layer in _OUTLIERS):
        return None
    return rotation_matrix(x.shape[-1], dtype, x.device)


def before_store(layer: int, cache: LayerKV, hooks: LayerHooks, md: Any, q: torch.Tensor, k: torch.Tensor,
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
    if cache.rotate_v and not hooks.rotate_v_in_weights:  # int4 values are stored as v R (the output
        v = v @ rotation_matrix(v.shape[-1], v.dtype, v.device)  # is rotated back in after_attention)
    if isinstance(cache, SimulatedKV):
        pos, seq = _step_positions(md, k.shape[0], k.device)
        k, v = cache.fake_quant.apply(k, v, pos, seq, cache.block_size)
    # (int4 samples whole blocks as they are quantized, after_attention)
    if hooks.monitor is not None and not isinstance(cache, Int4KV) and not _capturing(k):
        hooks.monitor.maybe_record(layer, cache.bits, k, v, cache.k.dtype if isinstance(cache, FullKV) else k.dtype)
    if hooks.probe is not None and not _capturing(k):
        hooks.probe(layer, q, k, v)
    attn_probe = md.extras.get("attn_probe") if getattr(md, "extras", None) else None
    if attn_probe is not None:  # sparsity (attention/hybrid): attention mass per block, sparsity.probe
        attn_probe.record(layer, cache, md, q, k)
    return q, k, v


def after_attention(layer: int, cache: LayerKV, hooks: LayerHooks, md: AttentionMetadata,
                    o: torch.Tensor) -> torch.Tensor:
    """o [T, Hq, D]: the step's attention output -> the same in the model's basis. Called by the
    attention layer after attention: int4 quantizes the blocks this step filled (once, from staging)
    and rotates the output back (values are stored rotated); a simulated quantize-on-fill format
    (FakeQuant.on_fill) quantizes its filled blocks in place."""
    if isinstance(cache, Int4KV):
        # the quality monitor's sample of the fill (eager steps): the first block this step fills,
        # read from staging (record_blocks samples one call in `every` itself)
        monitor = hooks.monitor
        if monitor is not None and not _capturing(o):
            sample = first_filled(cache)
            if sample is not None:
                monitor.record_blocks(layer, *sample)
        if md.fills_quantized:  # the decode kernel quantized them (cuda_decode_int4)
            md.fills_quantized = False
        elif cache.k.is_cuda:
            # one Triton kernel finds the filled blocks on the device (no host list, no copy, no sync;
            # bit for bit the torch quantize_filled): in captured decode steps from the step's slot
            # mapping; in eager steps from the filled blocks' last slots (the runner's, in the
            # step's one upload): one program per filled block, not per step token (a 16k-token
            # prefill chunk launched 262k programs per layer, 15 of 16 with nothing to do)
            from nanokv.kernels.triton_blockquant import prefill_fill_warps, quantize_filled_graphsafe
            fill = md.extras.get("fill_slots")  # prefill steps: one program per filled block
            quantize_filled_graphsafe(cache, md.slot_mapping if fill is None else fill,
                                      0 if fill is None else prefill_fill_warps())
        else:
            quantize_filled(cache)
    if cache.rotate_v and not hooks.rotate_v_in_weights:
        o = o @ rotation_matrix(o.shape[-1], o.dtype, o.device).T
    if isinstance(cache, SimulatedKV) and cache.fake_quant.on_fill:
        pos, _ = _step_positions(md, int(md.slot_mapping.shape[0]), md.slot_mapping.device)
        cache.fake_quant.fill_blocks(cache.k, cache.v, md.slot_mapping, pos)
    return o
