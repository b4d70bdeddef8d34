"""PrecisionActuator: the torch side of the KV bit-width rule, for one single-process ModelRunner.

It attaches an ErrorProbe to every layer that may change width (layers planned below 16 bits:
they are probed at every width from their planned one up to 8), reports the windowed errors, and
re-formats a layer's tensors when the controller widens or narrows it (nanokv.gateway.adaptive.reformat).
A layer never goes below its planned width. After a change captured CUDA graphs are re-captured:
they hold the old tensors' addresses.

Memory (docs/adaptive.md): widening one layer from int8 to 16 bits costs that layer
N x (bytes_per_block(16) - bytes_per_block(8)) more for as long as it stays wide, plus the old
tensor during the conversion. On CUDA the change is refused (and logged) unless that much device
memory is free now: the pool was sized at start-up, so leave headroom (gpu_memory_utilization)
for the layers you expect to back off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from nanokv.cache_service.kv.cache import bytes_per_block
from nanokv.compute_service.error_probe import ErrorProbe, probe_widths
from nanokv.gateway.adaptive.reformat import CHUNK_BLOCKS, reformat_layer
from nanokv.gateway.adaptive.rules import LADDER

log = logging.getLogger("nanokv.gateway.adaptive")


class PrecisionActuator:
    def __init__(self, runner: Any, recapture: Callable[[], None] | None = None, every: int = 2,
                 rows: int = 32) -> None:
        """runner: a nanokv.compute_service.runner.model_runner.ModelRunner (kv_caches, layer_bits, dtype, device).
        recapture: re-captures CUDA graphs after a change (None: no graphs)."""
        self.runner = runner
        self.recapture = recapture
        self.base_bits: list[int] = [c.bits for c in runner.kv_caches]
        widths = probe_widths(self.base_bits)
        self.probe = ErrorProbe(widths, every=every, rows=rows)
        for i in widths:
            runner.kv_caches[i].probe = self.probe

    def current_bits(self) -> list[int]:
        return [c.bits for c in self.runner.kv_caches]

    def window_errors(self) -> dict[int, dict[int, float]]:
        return self.probe.window_errors()

    def _memory_refusal(self, layer: int, bits: int) -> str:
        cache = self.runner.kv_caches[layer]
        if cache.k.device.type != "cuda":
            return ""
        D = int(self.runner.head_dim)
        per_block = bytes_per_block(bits, cache.num_kv_heads, cache.block_size, D, self.runner.dtype)
        scratch = 4 * 2 * CHUNK_BLOCKS * cache.num_kv_heads * cache.block_size * D  # float32 K and V
        need = cache.num_blocks * per_block + scratch
        free, _ = torch.cuda.mem_get_info(cache.k.device)
        if need > free:
            return f"needs {need / 2**20:.0f} MiB of device memory, {free / 2**20:.0f} MiB free"
        return ""

    def apply(self, changes: dict[int, int]) -> dict[int, str]:
        refused: dict[int, str] = {}
        changed = False
        for layer, bits in changes.items():
            old = self.runner.kv_caches[layer]
            if bits == old.bits:
                continue
            if bits < self.base_bits[layer] or bits not in LADDER:
                refused[layer] = f"{bits} bits is not allowed (planned {self.base_bits[layer]})"
                continue
            why = self._memory_refusal(layer, bits) if bits > old.bits else ""
            if why:
                refused[layer] = why
                continue
            # in place in the runner's list: the forward context and the graphs read this list
            self.runner.kv_caches[layer] = reformat_layer(old, bits, self.runner.dtype,
                                                          stage=getattr(self.runner, "stage", None))
            self.runner.layer_bits[layer] = bits
            changed = True
            log.info("adaptive kv_bits: layer %d re-formatted %d -> %d bits (%d blocks)", layer, old.bits,
                     bits, old.num_blocks)
        if changed and self.recapture is not None:
            self.recapture()
        return refused
