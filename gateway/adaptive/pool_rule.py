"""The KV pool size rule: grow from a reserve under pressure, shrink back to the start-up size when idle.

* Pressure (either): at least ``preemption_threshold`` preemptions in the window, or the window's peak
  of referenced blocks reached ``pool_high_usage`` x the pool while requests were waiting (blocks,
  not the batch limit, held them back). Then grow at once by ``pool_grow_fraction`` x the start-up
  size, capped by what memory allows now (``PoolControl.headroom_blocks``); no proposal when no
  block fits (the reserve is spent or the device is full).
* Idle: the pool is above its start-up size, no preemptions, nothing waiting, and the peak of
  referenced blocks stayed below ``pool_idle_usage`` x the start-up size, for PATIENCE_WINDOWS
  windows in a row. Then shrink back to the start-up size, or as far as the live sequences allow
  (``floor``: every running or waiting sequence must still fit whole, and the highest referenced
  block id stays).

Hysteresis: a window is never both (pressure resets the idle count), idle is measured against the
start-up size with ``pool_idle_usage`` < ``pool_high_usage`` (validated), and it must last
PATIENCE_WINDOWS windows, so a steady load neither flaps nor shrinks a pool it still fills.
Torch-free: the memory figures and the actual resize come through ``PoolControl``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from nanokv.gateway.adaptive.rules import Proposal
from nanokv.gateway.adaptive.settings import PATIENCE_WINDOWS, AdaptiveSettings
from nanokv.gateway.adaptive.window import WindowStats


class PoolControl(Protocol):
    """What the pool rule needs from the torch side (nanokv.compute_service.adaptive.pool.PoolActuator)."""

    base_blocks: int  # the start-up size: the floor the pool shrinks back to

    def headroom_blocks(self) -> int:
        """How many blocks the pool may grow by now (reserve left, device memory beyond the margin)."""
        ...

    def resize(self, num_blocks: int) -> tuple[int, str]:
        """Resize the cache manager and the KV tensors; (the new block count, '' or why not)."""
        ...


class PoolRule:
    kinds = ("pool_grow", "pool_shrink")

    def __init__(self, s: AdaptiveSettings) -> None:
        self.preemption_threshold = s.preemption_threshold
        self.grow_fraction = s.pool_grow_fraction
        self.high = s.pool_high_usage
        self.idle = s.pool_idle_usage
        self._idle_windows = 0

    def _pressure(self, w: WindowStats) -> str:
        if w.preemptions >= self.preemption_threshold:
            return f"{w.preemptions} preemptions in the window (threshold {self.preemption_threshold})"
        if w.peak_usage >= self.high and w.mean_waiting > 0:
            return (f"peak {w.peak_used_blocks}/{w.num_blocks} blocks in use (>= {self.high:g}) with "
                    f"{w.mean_waiting:.1f} requests waiting on average")
        return ""

    def evaluate(self, w: WindowStats, current: int, base: int, headroom: Callable[[], int],
                 floor: Callable[[], int]) -> Proposal | None:
        """current: the pool now; base: its start-up size; headroom() / floor(): blocks it may grow
        by / the least it may shrink to (asked only when needed: both cost more than a lookup)."""
        why = self._pressure(w)
        if why:
            self._idle_windows = 0
            room = headroom()
            add = min(max(1, math.ceil(self.grow_fraction * base)), room)
            if add < 1:
                return None  # no reserve left: nothing to propose (the concurrency rule still acts)
            target = current + add
            return Proposal("pool_grow", f"{current} -> {target} blocks", target,
                            f"{why}; room for {room} more blocks")
        idle = (current > base and w.preemptions == 0 and w.mean_waiting == 0
                and w.peak_used_blocks < self.idle * base)
        self._idle_windows = self._idle_windows + 1 if idle else 0
        if self._idle_windows < PATIENCE_WINDOWS:
            return None
        windows, self._idle_windows = self._idle_windows, 0
        target = max(base, floor())
        if target >= current:
            return None  # live sequences still hold the grown part; try again after the next idle spell
        return Proposal("pool_shrink", f"{current} -> {target} blocks", target,
                        f"idle for {windows} windows: peak {w.peak_used_blocks} blocks in use < "
                        f"{self.idle:g} x start-up size {base}, nothing waiting")
