"""PrecisionActuator: the torch side of the KV bit-width rule, for a runner in this process.

It attaches an ErrorProbe to every layer that may change width (layers planned below 16 bits:
they are probed at every width from their planned one up to 8), reports the windowed errors, and
has the runner re-format a layer's tensors when the controller widens or narrows it
(KVPool.reformat_kv, nanokv.compute_service.runner.kv_reformat), which also captures its CUDA graphs again
(they hold the old tensors' addresses). A layer never goes below its planned width. Under tensor
parallelism (TPModelRunner) the probe measures rank 0's KV heads, the most of any rank, and every
rank re-formats its shard in lock step; the memory check reads rank 0's device.

Memory (docs/adaptive.md): widening one layer from int8 to 16 bits costs that layer
N x (bytes_per_block(16) - bytes_per_block(8)) more for as long as it stays wide, plus the old
tensor during the conversion. On CUDA the change is refused (and logged) unless that much device
memory is free now beyond ``margin_bytes`` (adaptive_pool_margin_bytes, as for a pool grow): the
next forward, a CUDA graph capture among them, needs room too. The pool was sized at start-up, so
leave headroom (gpu_memory_utilization) for the layers you expect to back off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from nanokv.compute_service.adaptive_hooks import memory_shortfall
from nanokv.compute_service.error_probe import ErrorProbe, probe_widths
from nanokv.compute_service.runner.kv_reformat import CHUNK_BLOCKS
from nanokv.config import KV_WIDTHS as LADDER
from nanokv.kv.cache import bytes_per_block

log = logging.getLogger("nanokv.gateway.adaptive")


class PrecisionActuator:
    def __init__(self, runner: Any, every: int = 2, rows: int = 32, margin_bytes: int = 0,
                 before_change: Callable[[], None] | None = None) -> None:
        """runner: a ModelRunner or a TPModelRunner (kv_caches, layer_hooks, layer_bits, reformat_kv, dtype,
        head_dim).
        margin_bytes: CUDA device memory a widening must leave free.
        before_change: called right before a re-format (the engine lands its step in flight)."""
        self.runner = runner
        self.margin_bytes = margin_bytes
        self.before_change = before_change
        self.base_bits: list[int] = [c.bits for c in runner.kv_caches]
        widths = probe_widths(self.base_bits)
        self.probe = ErrorProbe(widths, every=every, rows=rows)
        for i in widths:
            runner.layer_hooks[i].probe = self.probe

    def current_bits(self) -> list[int]:
        return [c.bits for c in self.runner.kv_caches]

    def window_errors(self) -> dict[int, dict[int, float]]:
        return self.probe.window_errors()

    def _memory_refusal(self, layer: int, bits: int, grown: int) -> tuple[str, int]:
        """Why widening `layer` does not fit ('' if it does), and the bytes the layer grows by.
        grown: what the layers changed before it in this call add (their old tensors are gone by then,
        unless they were views of the pool's segment)."""
        cache = self.runner.kv_caches[layer]
        if cache.k.device.type != "cuda":
            return "", 0
        D = int(self.runner.head_dim)
        size = cache.num_blocks * bytes_per_block(bits, cache.num_kv_heads, cache.block_size, D, self.runner.dtype)
        old = cache.num_blocks * bytes_per_block(cache.bits, cache.num_kv_heads, cache.block_size, D,
                                                 self.runner.dtype)
        scratch = 4 * 2 * CHUNK_BLOCKS * cache.num_kv_heads * cache.block_size * D  # float32 K and V
        why = memory_shortfall(cache.k.device, grown + size + scratch, self.margin_bytes)
        if why:
            return why, 0
        # a layer still carved from the start-up segment frees nothing when it moves out: the segment
        # stays until every layer has (KVPool._moved_out)
        return "", size - (0 if layer in getattr(self.runner, "in_segment", ()) else old)

    def apply(self, changes: dict[int, int]) -> dict[int, str]:
        refused: dict[int, str] = {}
        ok: dict[int, int] = {}
        grown = 0
        for layer, bits in changes.items():
            old = self.runner.kv_caches[layer].bits
            if bits == old:
                continue
            if bits < self.base_bits[layer] or bits not in LADDER:
                refused[layer] = f"{bits} bits is not allowed (planned {self.base_bits[layer]})"
                continue
            why, extra = self._memory_refusal(layer, bits, grown) if bits > old else ("", 0)
            if why:
                refused[layer] = why
                continue
            grown += extra
            ok[layer] = bits
        before = self.current_bits()
        if ok and self.before_change is not None:
            self.before_change()
        self.runner.reformat_kv(ok)  # in place in the runner's list: the forward context and the graphs read it
        for layer, bits in ok.items():
            log.info("adaptive kv_bits: layer %d re-formatted %d -> %d bits (%d blocks)", layer, before[layer],
                     bits, self.runner.kv_caches[layer].num_blocks)
        return refused
