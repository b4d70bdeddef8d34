"""PoolActuator: the torch side of the KV pool rule, for one single-process ModelRunner.

A resize changes two things that must agree on the block count: the cache manager's block pool
(pure Python: which ids exist, which are free) and every layer's KV tensors (nanokv.compute_service.runner.kv_resize).
Grow: tensors first, then the manager hands out the new ids. Shrink: the manager first (it removes
the highest ids only as far as no referenced block is touched, evicting cached ones), then the
tensors follow to the count it reached. The runner re-captures its decode CUDA graphs and, after a
shrink, returns the memory to the device (ModelRunner.resize_kv).

How far it may grow (``headroom_blocks``):
  * ``adaptive_pool_reserve_bytes`` caps the growth beyond the start-up size (on any device);
  * on CUDA, the device memory free now (torch.cuda.mem_get_info) less ``adaptive_pool_margin_bytes``
    and less one layer's current tensors (a layer's old and new tensors coexist during its copy);
  * on CPU there is no free-memory figure worth trusting: the reserve is the budget (no reserve:
    the rule is off, see engine_glue).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from nanokv.kv.cache import bytes_per_block

log = logging.getLogger("nanokv.gateway.adaptive")


class PoolActuator:
    def __init__(self, runner: Any, cache_manager: Any, reserve_bytes: int | None, margin_bytes: int,
                 before_change: Callable[[], None] | None = None) -> None:
        """runner: a nanokv.compute_service.runner.model_runner.ModelRunner; cache_manager: its KVCacheManager.
        before_change: called right before a resize (the engine lands its step in flight)."""
        self.runner = runner
        self.before_change = before_change
        self.cm = cache_manager
        self.base_blocks: int = cache_manager.num_blocks
        self.reserve_bytes = reserve_bytes
        self.margin_bytes = margin_bytes

    def bytes_per_block(self) -> int:
        """One block in every layer at its current width (the KV-width rule may have changed some)."""
        r = self.runner
        return sum(bytes_per_block(c.bits, c.num_kv_heads, c.block_size, r.head_dim, r.dtype)
                   for c in r.kv_caches)

    def headroom_blocks(self) -> int:
        per_block = self.bytes_per_block()
        grown = self.cm.num_blocks - self.base_blocks
        room = None if self.reserve_bytes is None else self.reserve_bytes // per_block - grown
        device = self.runner.device
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            # a resize copies a layer at a time; while the layers are views of the start-up segment,
            # that segment stays until the last one has moved (KVPool._moved_out): all of it counts
            in_segment = bool(getattr(self.runner, "in_segment", ()))
            copy = -(-self.cm.num_blocks * per_block // (1 if in_segment else max(1, len(self.runner.kv_caches))))
            fits = (free - self.margin_bytes - copy) // per_block
            room = fits if room is None else min(room, fits)
        return max(0, int(room or 0))

    def resize(self, num_blocks: int) -> tuple[int, str]:
        cur = self.cm.num_blocks
        if num_blocks > cur:
            room = self.headroom_blocks()
            if num_blocks - cur > room:
                return cur, f"needs {num_blocks - cur} more blocks, memory allows {room}"
            if self.before_change is not None:
                self.before_change()
            try:
                self.runner.resize_kv(num_blocks)
            except torch.OutOfMemoryError as e:
                self.runner.resize_kv(cur)  # back to a consistent state (frees what the grow took)
                torch.cuda.empty_cache()
                return cur, f"out of device memory while growing ({e})"
            self.cm.resize(num_blocks)
        elif num_blocks < cur:
            if self.before_change is not None:
                self.before_change()
            got = self.cm.resize(num_blocks)
            self.runner.resize_kv(got)
        log.info("KV pool %d -> %d blocks (start-up size %d)", cur, self.cm.num_blocks, self.base_blocks)
        return self.cm.num_blocks, ""
