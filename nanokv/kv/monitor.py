"""Running per-layer compression error of the KV store: ||x - dequant(quant(x))|| / ||x||.

One CompressionMonitor per engine, attached to that engine's layers (`attach`: each layer's
run-time hooks, nanokv.compute_service.kv_hooks.LayerHooks). The store
hook (nanokv.compute_service.kv_hooks.before_store) calls `maybe_record` with the exact K/V rows about to be
stored (int4: `record_blocks` with each block as it is quantized, nanokv.kv.blockquant); every
`every`-th call per layer it quantizes up to `rows` sampled rows with the reference
quantizer of that layer's format and folds the error into an exponentially weighted average.
Cost: one small quant/dequant per layer every `every` steps, the layers' turns spread over the
steps (a few layers per step rather than all of them in one step of `every`).

The figure per layer is the relative error of the sampled rows taken together,
sqrt(sum ||x - x~||^2 / sum ||x||^2), for K and V separately; `snapshot()` reports the worse of the
two (keys are usually the sensitive side), `snapshot_kv()` both.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Protocol

import torch

from nanokv.kv import quant


def roundtrip(x: torch.Tensor, bits: int, store_dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] -> what the store keeps of it, dequantized, float32 (the reference formats)."""
    if bits >= 16:
        return x.to(store_dtype).float()
    if bits == 8:
        c, s = quant.quantize_int8(x)
        return quant.dequantize_int8(c, s, torch.float32)
    if bits == 4:
        c, s, z = quant.quantize_int4(x)
        return quant.dequantize_int4(c, s, z, torch.float32)
    raise ValueError(f"unsupported KV bit width {bits}")


def relative_error_t(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """Aggregate relative L2 error of rows x [..., D] vs their reconstruction x_hat, as a 0-dim
    tensor on x's device (0 for all-zero x): no host sync."""
    xf = x.float()
    den = xf.pow(2).sum()
    num = (xf - x_hat.float()).pow(2).sum()
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float32).tiny), 0.0).sqrt()


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return float(relative_error_t(x, x_hat))


def spread_rows(n: int, rows: int, tick: int, device: torch.device) -> torch.Tensor | None:
    """Indices of `rows` of n rows, evenly spread, shifted by `tick` so successive samples visit
    different rows; None when n <= rows (take all). Built on the device: no host RNG over n (a CPU
    randperm of a 16k-token prefill's 131k rows took 4.7 ms per layer) and no host-to-device copy,
    which would stall the host behind the queued GPU work."""
    if n <= rows:
        return None
    stride = n // rows
    return torch.arange(rows, device=device) * stride + tick % stride


class Attachable(Protocol):
    """A layer's run-time hooks: where the store hooks look for the monitor."""

    monitor: CompressionMonitor | None


class CompressionMonitor:
    def __init__(self, every: int = 8, rows: int = 64, alpha: float = 0.2, seed: int = 0):
        if every < 1 or rows < 1 or not 0.0 < alpha <= 1.0:
            raise ValueError("CompressionMonitor needs every >= 1, rows >= 1, 0 < alpha <= 1")
        self.every = every  # sample one store call in `every`, per layer
        self.rows = rows  # (token, head) rows per sample
        self.alpha = alpha  # EWMA weight of the newest sample
        self._tick = seed  # rotates the sampled rows (spread_rows)
        self._calls: dict[int, int] = {}
        # running errors as 0-dim device tensors (floats for exact formats), read on snapshot only
        self._k: dict[int, torch.Tensor | float] = {}
        self._v: dict[int, torch.Tensor | float] = {}
        self._lock = threading.Lock()  # stats() may be read from the server thread

    def attach(self, layers: Iterable[Attachable]) -> CompressionMonitor:
        """Make every layer (its hooks) report to this monitor. Returns self."""
        for h in layers:
            h.monitor = self
        return self

    def _due(self, layer: int) -> bool:
        """Count a call of `layer`; True for its first call and then one in `every`, staggered by
        layer: with all layers due at the same call, one step in `every` paid every layer's sample
        (~60 ms of host time in a 16k-token int4 prefill step on an H200, where the device waits on
        the host; docs/kernels.md, "Host time"), while spread out each step pays a few layers'."""
        n = self._calls.get(layer, 0)
        self._calls[layer] = n + 1
        return n == 0 or (n + layer) % self.every == 0

    def maybe_record(self, layer: int, bits: int, k: torch.Tensor, v: torch.Tensor,
                     store_dtype: torch.dtype = torch.float32) -> None:
        """Called on every store; records one call in `every` (the first call of a layer included)."""
        if self._due(layer):
            self.record(layer, bits, k, v, store_dtype)

    def record(self, layer: int, bits: int, k: torch.Tensor, v: torch.Tensor,
               store_dtype: torch.dtype = torch.float32) -> None:
        """k, v [T, H, D] as handed to the store -> update the layer's running K and V errors."""
        if bits >= 16 and k.dtype == store_dtype:
            self._fold(layer, 0.0, 0.0)  # stored as given: exact, and no device sync to find that out
            return
        D = k.shape[-1]
        kr, vr = k.reshape(-1, D), v.reshape(-1, D)  # [T*H, D] rows: the quantization unit
        idx = spread_rows(kr.shape[0], self.rows, self._tick, kr.device)
        self._tick += 1
        if idx is not None:
            kr, vr = kr[idx], vr[idx]
        self._fold(layer, relative_error_t(kr, roundtrip(kr, bits, store_dtype)),
                   relative_error_t(vr, roundtrip(vr, bits, store_dtype)))

    def record_blocks(self, layer: int, kb: torch.Tensor, vb: torch.Tensor) -> None:
        """int4 (quantized per block when it fills): kb, vb [F, H, bs, D] full blocks about to be
        quantized, keys per channel over the block, values per token. Samples one call in `every`."""
        if not self._due(layer) or kb.shape[0] == 0:
            return
        kb, vb = kb[:1].float(), vb[:1].float()  # one block: H * bs rows
        k_hat = quant.dequantize_int4_channels(*quant.quantize_int4_channels(kb), torch.float32)
        self._fold(layer, relative_error_t(kb, k_hat), relative_error_t(vb, roundtrip(vb, 4, torch.float32)))

    def _fold(self, layer: int, ek: torch.Tensor | float, ev: torch.Tensor | float) -> None:
        with self._lock:
            for store, e in ((self._k, ek), (self._v, ev)):
                old = store.get(layer)
                store[layer] = e if old is None else (1 - self.alpha) * old + self.alpha * e

    def snapshot(self) -> dict[int, float]:
        """{layer: running relative error, the worse of K and V} for the layers seen so far."""
        with self._lock:
            return {i: max(float(self._k[i]), float(self._v[i])) for i in sorted(self._k)}

    def snapshot_kv(self) -> dict[int, dict[str, float]]:
        with self._lock:
            return {i: {"k": float(self._k[i]), "v": float(self._v[i])} for i in sorted(self._k)}

    def reset(self) -> None:
        with self._lock:
            self._calls.clear()
            self._k.clear()
            self._v.clear()
