"""Windowed figures: what the rules read. Every figure is a difference of monotonic counters over
the last window (or a gauge sampled on each of its steps), never a lifetime total, so the
controller reacts to what the engine does now."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class CacheCounters(Protocol):
    """The cache counters a window reads: a KVCacheManager's CacheStats, or the remote cache's."""
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    evictions: int
    recomputed_tokens: int


@dataclass(frozen=True)
class Counters:
    """Monotonic totals at one instant (from CacheStats and the scheduler)."""

    step: int = 0
    queries_tokens: int = 0
    hits_tokens: int = 0
    evictions: int = 0
    recomputed_tokens: int = 0
    computed_tokens: int = 0
    preemptions: int = 0

    @classmethod
    def read(cls, step: int, cache_stats: CacheCounters | None, computed_tokens: int, preemptions: int) -> Counters:
        cs = cache_stats
        if cs is None:
            return cls(step, computed_tokens=computed_tokens, preemptions=preemptions)
        return cls(step, cs.prefix_queries_tokens, cs.prefix_hits_tokens, cs.evictions, cs.recomputed_tokens,
                   computed_tokens, preemptions)


@dataclass(frozen=True)
class WindowStats:
    start_step: int
    end_step: int
    queries_tokens: int
    hits_tokens: int
    evictions: int
    recomputed_tokens: int
    computed_tokens: int
    preemptions: int
    peak_running: int  # largest batch (running sequences) seen in the window
    mean_waiting: float  # queue length, averaged over the window's steps
    peak_used_blocks: int = 0  # most KV blocks referenced at once in the window (cached-only ones excluded)
    num_blocks: int = 0  # KV pool size at the window's end (0: no cache manager)

    @property
    def peak_usage(self) -> float:
        """peak_used_blocks / the pool size (0 without a cache manager)."""
        return self.peak_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def steps(self) -> int:
        return self.end_step - self.start_step

    @property
    def hit_rate(self) -> float | None:
        """Prefix-cache hit tokens / query tokens; None when nothing was looked up."""
        return self.hits_tokens / self.queries_tokens if self.queries_tokens else None

    @property
    def recompute_overhead(self) -> float:
        """Tokens computed again because their KV was evicted or preempted, per computed token."""
        return self.recomputed_tokens / self.computed_tokens if self.computed_tokens else 0.0

    @property
    def evictions_per_step(self) -> float:
        return self.evictions / self.steps if self.steps else 0.0

    def describe(self) -> str:
        hr = "n/a" if self.hit_rate is None else f"{self.hit_rate:.3f}"
        return (f"steps {self.start_step}-{self.end_step}: hit rate {hr}, evictions {self.evictions}, "
                f"recompute {self.recompute_overhead:.1%}, preemptions {self.preemptions}, "
                f"peak batch {self.peak_running}, mean queue {self.mean_waiting:.1f}, "
                f"peak blocks {self.peak_used_blocks}/{self.num_blocks}")


class WindowMeter:
    """Collects one window: counters at its start, gauges on each step."""

    def __init__(self, start: Counters) -> None:
        self.start = start
        self.peak_running = 0
        self.peak_used_blocks = 0
        self.waiting_sum = 0
        self.samples = 0

    def sample(self, running: int, waiting: int, used_blocks: int = 0) -> None:
        self.peak_running = max(self.peak_running, running)
        self.peak_used_blocks = max(self.peak_used_blocks, used_blocks)
        self.waiting_sum += waiting
        self.samples += 1

    def close(self, end: Counters, num_blocks: int = 0) -> WindowStats:
        s = self.start
        return WindowStats(
            s.step, end.step, end.queries_tokens - s.queries_tokens, end.hits_tokens - s.hits_tokens,
            end.evictions - s.evictions, end.recomputed_tokens - s.recomputed_tokens,
            end.computed_tokens - s.computed_tokens, end.preemptions - s.preemptions, self.peak_running,
            self.waiting_sum / self.samples if self.samples else 0.0, self.peak_used_blocks, num_blocks,
        )
