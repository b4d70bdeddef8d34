"""Observability: the engine's counters, counted per step, read as one stats() snapshot (what
/metrics, the benches and the tests report) and reset at start-up. EngineCounters holds the token
and batch-size counters (the gateway's time per step is Engine.rpc); stats() reads them with the
services' own counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from nanokv.gateway.engine import Engine
    from nanokv.gateway.scheduler import SchedulerOutput

_MAX_BATCH_SAMPLES = 10000  # the samples stay bounded when no one calls stats()


class EngineStats(TypedDict):
    kv_cache_usage: float
    kv_blocks_total: int  # changes when the adaptive pool rule resizes
    num_running: int
    num_waiting: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    evictions_by_policy: dict[str, int]
    eviction_policy: str  # the live one (the controller may switch)
    recomputed_tokens: int
    preemptions: int
    last_batch_size: int
    batch_sizes: list[int]  # every step's since the last stats()
    compression_error: dict[int, float]
    adaptations: dict[str, int]
    rpc: dict[str, float]
    prompt_tokens: int
    generation_tokens: int
    computed_tokens: int
    # the memory hierarchy ({} without lower tiers): per tier / per move, as the cache service counts
    tier_hit_tokens: dict[str, int]
    tier_blocks: dict[str, int]
    tier_capacity_blocks: dict[str, int]
    tier_moved_blocks: dict[str, int]
    tier_moved_bytes: dict[str, int]
    tier_health: dict[str, int]  # the disk and shared tiers' disk_tier_* / remote_tier_* by name
    onload_seconds: list[float]  # every load's issue-to-landed time since the last stats()


class EngineCounters:
    """Tokens in (prompts), out (sampled) and through the model, and the batch size of every step."""

    def __init__(self) -> None:
        self.tokens = {"prompt_tokens": 0, "generation_tokens": 0, "computed_tokens": 0}
        self.batch_sizes: list[int] = []  # drained by stats()
        self.last_batch_size = 0
        self.onload_s: list[float] = []  # drained by stats(): steps that loaded blocks from lower tiers

    def count_step(self, out: SchedulerOutput) -> None:
        """A scheduled step's tokens and batch size."""
        self.tokens["computed_tokens"] += out.num_tokens
        self.last_batch_size = len(out.scheduled)
        self.batch_sizes.append(self.last_batch_size)
        if len(self.batch_sizes) > _MAX_BATCH_SAMPLES:
            del self.batch_sizes[:_MAX_BATCH_SAMPLES // 2]

    def drain_onloads(self) -> list[float]:
        out, self.onload_s = self.onload_s[-_MAX_BATCH_SAMPLES:], []
        return out

    def drain_batch_sizes(self) -> list[int]:
        sizes, self.batch_sizes = self.batch_sizes, []
        return sizes

    def reset(self) -> None:
        self.tokens = dict.fromkeys(self.tokens, 0)
        self.batch_sizes.clear()
        self.onload_s.clear()
        self.last_batch_size = 0


def reset_counters(eng: Engine) -> None:
    """Every counter stats() reports back to zero (start-up only: nanokv.gateway.warmup)."""
    eng.flush()
    eng.cache.reset_prefix_cache(clear_stats=True)
    eng.compute.reset_stats()
    eng.scheduler.num_preemptions = 0
    eng.counters.reset()
    for k in eng.rpc:
        eng.rpc[k] = 0.0 if k.endswith("_s") else 0
    eng.cache.plan_rtt_s = 0.0


def stats(eng: Engine) -> EngineStats:
    """One snapshot of the engine, its cache and compute services. Drains the batch-size samples."""
    cs = eng.cache.stats()
    comp = eng.compute.stats()
    tokens = eng.counters.tokens
    return EngineStats(
        kv_cache_usage=cs["kv_cache_usage"], kv_blocks_total=cs["kv_blocks_total"],
        num_running=eng.num_running(), num_waiting=eng.num_waiting(),
        prefix_queries_tokens=cs["prefix_queries_tokens"], prefix_hits_tokens=cs["prefix_hits_tokens"],
        evictions_by_policy=cs["evictions_by_policy"], eviction_policy=cs["eviction_policy"],
        recomputed_tokens=cs["recomputed_tokens"], preemptions=eng.scheduler.num_preemptions,
        last_batch_size=eng.counters.last_batch_size, batch_sizes=eng.counters.drain_batch_sizes(),
        compression_error=comp["compression_error"],
        adaptations=dict(eng.controller.counts) if eng.controller is not None else {},
        rpc=dict(eng.rpc, plan_rtt_s=eng.cache.plan_rtt_s),
        prompt_tokens=tokens["prompt_tokens"], generation_tokens=tokens["generation_tokens"],
        computed_tokens=tokens["computed_tokens"],
        tier_hit_tokens=dict(cs.get("tier_hit_tokens") or {}), tier_blocks=dict(cs.get("tier_blocks") or {}),
        tier_capacity_blocks=dict(cs.get("tier_capacity_blocks") or {}),
        tier_moved_blocks=dict(cs.get("tier_moved_blocks") or {}),
        tier_moved_bytes=dict(cs.get("tier_moved_bytes") or {}), tier_health=dict(cs.get("tier_health") or {}),
        onload_seconds=eng.counters.drain_onloads(),
    )
