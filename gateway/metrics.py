"""Prometheus metrics for one engine, fed only by reading `engine.stats()` and finished outputs.

Names follow Prometheus conventions: `nanokv_` prefix, base units as suffix (`_seconds`,
`_tokens`, `_ratio`), `_total` on counters. The engine's counters are cumulative, so they are
exported by a custom collector that reports the latest snapshot as-is (never incremented here);
histograms are observed from the per-step batch sizes and per-request timestamps.

Each app owns one `EngineMetrics` with its own CollectorRegistry: no global state, so two apps (or
two tests) never see each other's series.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from nanokv.gateway.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# (metric name, stats key, help) for the engine's cumulative counters
_COUNTERS = (
    ("nanokv_prefix_cache_query_tokens", "prefix_queries_tokens", "Prompt tokens looked up in prefix cache."),
    ("nanokv_prefix_cache_hit_tokens", "prefix_hits_tokens", "Prompt tokens found in the prefix cache."),
    ("nanokv_recomputed_tokens", "recomputed_tokens", "Tokens computed again after preemption or eviction."),
    ("nanokv_preemptions", "preemptions", "Requests preempted (KV freed, recomputed later)."),
    ("nanokv_computed_tokens", "computed_tokens", "Tokens run through the model (prefill and decode)."),
    ("nanokv_prompt_tokens", "prompt_tokens", "Prompt tokens of admitted requests."),
    ("nanokv_generation_tokens", "generation_tokens", "Tokens generated."),
)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, *, hit_ratio_window_s: float = 60.0):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.hit_ratio_window_s = hit_ratio_window_s
        self._lock = threading.Lock()
        self._stats: Mapping[str, Any] = {}  # an engine.stats() snapshot (EngineStats), {} before the first
        self._window: deque[tuple[float, int, int]] = deque()  # (time, query tokens, hit tokens)
        r = self.registry
        self.batch_size = Histogram(
            "nanokv_batch_size_requests", "Requests per engine step.", buckets=_BATCH_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "nanokv_time_to_first_token_seconds", "Arrival to first generated token.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            "nanokv_time_per_output_token_seconds", "Mean time between output tokens of a request.",
            buckets=_TPOT_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "nanokv_e2e_request_latency_seconds", "Arrival to finish.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.onload = Histogram(
            "nanokv_tier_onload_seconds", "Blocks loaded from the lower KV tiers: from the step that carries "
            "the loads being sent to its result (the blocks landed and read).", buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.finished = Counter(
            "nanokv_requests_finished", "Requests finished, by reason (stop, length, abort).",
            ["finish_reason"], registry=r,
        )
        self.rejected = Counter(
            "nanokv_requests_rejected", "HTTP requests answered with an error, by status code.",
            ["status"], registry=r,
        )
        r.register(_StatsCollector(self))

    # ---- feeding (engine thread / request handlers) -----------------------------------------
    def update(self, stats: Mapping[str, Any]) -> None:
        """Take one `engine.stats()` snapshot (its `batch_sizes` were drained for us)."""
        for b in stats.get("batch_sizes", ()):
            self.batch_size.observe(b)
        for s in stats.get("onload_seconds", ()):
            self.onload.observe(s)
        now = time.monotonic()
        with self._lock:
            self._stats = stats
            self._window.append((now, int(stats.get("prefix_queries_tokens", 0)),
                                 int(stats.get("prefix_hits_tokens", 0))))
            # keep one sample older than the window as the baseline of the difference
            while len(self._window) > 2 and self._window[1][0] <= now - self.hit_ratio_window_s:
                self._window.popleft()

    def observe_finished(self, output: RequestOutput) -> None:
        self.finished.labels(output.finish_reason or "unknown").inc()
        m = output.metrics
        arrival, first, finish = m.arrival_time, m.first_token_time, m.finish_time
        if arrival is not None and first is not None:
            self.ttft.observe(max(0.0, first - arrival))
        if arrival is not None and finish is not None:
            self.e2e.observe(max(0.0, finish - arrival))
        n = len(output.token_ids)
        if first is not None and finish is not None and n > 1:
            self.tpot.observe(max(0.0, (finish - first) / (n - 1)))

    def observe_abort(self) -> None:
        self.finished.labels("abort").inc()

    def observe_rejection(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    # ---- reading ----------------------------------------------------------------------------
    def snapshot(self) -> tuple[Mapping[str, Any], float]:
        """The latest stats and the prefix-cache hit ratio over the window (NaN: no lookups)."""
        with self._lock:
            stats = self._stats
            if len(self._window) < 2:
                return stats, math.nan
            (_, q0, h0), (_, q1, h1) = self._window[0], self._window[-1]
        return stats, (h1 - h0) / (q1 - q0) if q1 > q0 else math.nan

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StatsCollector:
    """Exports the latest snapshot at scrape time; every family is always present (zeros at start)."""

    def __init__(self, metrics: EngineMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats, hit_ratio = self.metrics.snapshot()
        yield GaugeMetricFamily("nanokv_kv_cache_usage_ratio", "Fraction of KV blocks in use (0-1).",
                                value=float(stats.get("kv_cache_usage", 0.0)))
        yield GaugeMetricFamily("nanokv_kv_cache_blocks", "KV blocks in the pool (the adaptive pool rule "
                                "grows and shrinks it).", value=stats.get("kv_blocks_total", 0))
        yield GaugeMetricFamily("nanokv_num_requests_running", "Requests in the running batch.",
                                value=stats.get("num_running", 0))
        yield GaugeMetricFamily("nanokv_num_requests_waiting", "Requests waiting to be scheduled.",
                                value=stats.get("num_waiting", 0))
        yield GaugeMetricFamily(
            "nanokv_prefix_cache_hit_ratio",
            f"Prefix-cache hit tokens / query tokens over the last {self.metrics.hit_ratio_window_s:g}s.",
            value=hit_ratio,
        )
        for name, key, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0))
        policy = str(stats.get("eviction_policy", "unknown"))
        evictions = CounterMetricFamily(
            "nanokv_prefix_cache_evictions", "Cached blocks evicted, by eviction policy.", labels=["policy"]
        )
        by_policy = dict(stats.get("evictions_by_policy") or {})
        by_policy.setdefault(policy, 0)
        for p, v in sorted(by_policy.items()):
            evictions.add_metric([str(p)], v)
        yield evictions
        info = GaugeMetricFamily("nanokv_eviction_policy_info", "The active eviction policy (value 1).",
                                 labels=["policy"])
        info.add_metric([policy], 1)
        yield info
        err = GaugeMetricFamily("nanokv_kv_compression_error", "KV compression error per layer, as the "
                                "kv layer reports it (0 when compression is off).", labels=["layer"])
        for layer, v in sorted((stats.get("compression_error") or {}).items(), key=lambda kv: int(kv[0])):
            err.add_metric([str(layer)], float(v))
        yield err
        yield from _tier_metrics(stats)
        adapt = CounterMetricFamily("nanokv_adaptations", "Self-tuning actions, by kind.", labels=["kind"])
        for kind, v in sorted((stats.get("adaptations") or {}).items()):
            adapt.add_metric([str(kind)], v)
        yield adapt


def _tier_metrics(stats: Mapping[str, Any]) -> Iterator[Metric]:
    """The memory hierarchy's families (docs/hierarchy.md); without lower tiers they have no samples."""
    hits = CounterMetricFamily("nanokv_tier_hit_tokens", "Prompt tokens served from each KV tier.", labels=["tier"])
    blocks = GaugeMetricFamily("nanokv_tier_blocks", "KV blocks resident in each tier.", labels=["tier"])
    cap = GaugeMetricFamily("nanokv_tier_capacity_blocks", "KV blocks each tier holds at most.", labels=["tier"])
    moved = CounterMetricFamily("nanokv_tier_moved_blocks", "KV blocks copied between tiers, by direction.",
                                labels=["src", "dst"])
    for t, v in sorted((stats.get("tier_hit_tokens") or {}).items()):
        hits.add_metric([t], v)
    for t, v in sorted((stats.get("tier_blocks") or {}).items()):
        blocks.add_metric([t], v)
    for t, v in sorted((stats.get("tier_capacity_blocks") or {}).items()):
        cap.add_metric([t], v)
    moved_bytes = CounterMetricFamily("nanokv_tier_moved_bytes", "KV bytes copied between tiers, by direction "
                                      "(blocks in the lower tier's format).", labels=["src", "dst"])
    for move, v in sorted((stats.get("tier_moved_blocks") or {}).items()):
        src, _, dst = move.partition("->")
        moved.add_metric([src, dst], v)
    for move, v in sorted((stats.get("tier_moved_bytes") or {}).items()):
        src, _, dst = move.partition("->")
        moved_bytes.add_metric([src, dst], v)
    yield from (hits, blocks, cap, moved, moved_bytes)
    # the disk and shared tiers' health (admitting, errors, drops, queue overflows: docs/hierarchy.md)
    for name, v in sorted((stats.get("tier_health") or {}).items()):
        if name.endswith("_total"):
            yield CounterMetricFamily(f"nanokv_{name.removesuffix('_total')}", f"The {name} counter.", value=v)
        else:
            yield GaugeMetricFamily(f"nanokv_{name}", f"The {name} gauge.", value=v)
