"""Observability: the engine's counters, counted per step, read as one stats() snapshot (what
/metrics, the benches and the tests report) and reset at start-up. The counters themselves live on
the Engine (`_counters`, `rpc`, `_batch_sizes`, `_last_batch_size`); these functions fill, read and
zero them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanokv.gateway.engine import Engine


def count_step(eng: Engine, out: Any) -> None:
    """A scheduled step's tokens and batch size (the samples stay bounded when no one calls stats())."""
    eng._counters["computed_tokens"] += out.num_tokens
    eng._last_batch_size = len(out.scheduled)
    eng._batch_sizes.append(len(out.scheduled))
    if len(eng._batch_sizes) > 10000:
        del eng._batch_sizes[:5000]


def reset_counters(eng: Engine) -> None:
    """Every counter stats() reports back to zero (start-up only: nanokv.gateway.warmup)."""
    eng.flush()
    eng.cache.reset_prefix_cache(clear_stats=True)
    eng.compute.reset_stats()
    eng.scheduler.num_preemptions = 0
    eng._counters = dict.fromkeys(eng._counters, 0)
    eng._batch_sizes.clear()
    eng._last_batch_size = 0
    eng.rpc = dict.fromkeys(eng.rpc, 0) | {k: 0.0 for k in eng.rpc if k.endswith("_s")}
    if hasattr(eng.cache, "plan_rtt_s"):
        eng.cache.plan_rtt_s = 0.0


def stats(eng: Engine) -> dict[str, Any]:
    """One snapshot of the engine, its cache and compute services. Drains the batch-size samples."""
    cs = eng.cache.stats()
    comp = eng.compute.stats()
    batch_sizes, eng._batch_sizes = eng._batch_sizes, []
    return {
        "kv_cache_usage": cs["kv_cache_usage"],
        "kv_blocks_total": cs["kv_blocks_total"],  # changes when the adaptive pool rule resizes
        "num_running": eng.num_running(),
        "num_waiting": eng.num_waiting(),
        "prefix_queries_tokens": cs["prefix_queries_tokens"],
        "prefix_hits_tokens": cs["prefix_hits_tokens"],
        "evictions_by_policy": cs["evictions_by_policy"],
        "eviction_policy": cs["eviction_policy"],  # the live one (the controller may switch)
        "recomputed_tokens": cs["recomputed_tokens"],
        "preemptions": eng.scheduler.num_preemptions,
        "last_batch_size": eng._last_batch_size,
        "batch_sizes": batch_sizes,
        "compression_error": comp["compression_error"],
        "adaptations": dict(eng.controller.counts) if eng.controller is not None else {},
        "rpc": dict(eng.rpc, plan_rtt_s=getattr(eng.cache, "plan_rtt_s", 0.0)),
        **eng._counters,
    }
