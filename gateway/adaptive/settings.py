"""The controller's thresholds, lifted out of EngineConfig so the torch-free parts never need it."""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from nanokv.config import ADAPTIVE_POLICY_CANDIDATES

# Fixed knobs (not in EngineConfig: they shape the hysteresis, not the policy):
PATIENCE_WINDOWS = 2  # a change that needs no alarm (steady regret, recovery) waits this many windows
# A ghost's lead counts when it is this many standard deviations (paired test, nanokv.cache_service.ghosts):
SIGNIFICANCE_Z = 2.0  # ... on its own (then it must also last PATIENCE_WINDOWS windows)
RECOVER_RATIO = 0.5  # a backed-off layer returns only when the narrower width's error < this x bound
LOWER_FACTOR = 0.75  # max_num_seqs is cut to this fraction of the window's peak batch
RAISE_FACTOR = 0.25  # ... and raised by this fraction (at least 1) once preemptions have stopped


def alarm_z(alternatives: int) -> float:
    """The lead a ghost needs when the live hit rate is falling while evictions rise (then the rule
    acts at once, on one window). That window's best of ``alternatives`` ghosts is tested, so the
    one-sided level of SIGNIFICANCE_Z is split over them (Bonferroni): one window of noise is then no
    likelier to switch with four candidates than with two. 2.0 for one alternative, 2.43 for three.
    Without it the Mooncake trace at 1 % switched on a noise window and ended at 0.95x LRU
    (docs/cache-policies.md, "Adaptive"). The steady path needs no split: its lead must hold
    PATIENCE_WINDOWS windows in a row."""
    level = 1.0 - NormalDist().cdf(SIGNIFICANCE_Z)
    return NormalDist().inv_cdf(1.0 - level / max(1, alternatives))


@dataclass(frozen=True)
class AdaptiveSettings:
    mode: str = "act"  # "act" changes the engine, "recommend" only logs and counts
    window_steps: int = 64
    hit_rate_threshold: float = 0.85
    policy_switch_margin: float = 0.01
    policy_candidates: tuple[str, ...] = tuple(ADAPTIVE_POLICY_CANDIDATES.split(","))
    compression_error_bound: float = 1.0
    preemption_threshold: int = 1
    max_num_seqs: int = 256  # the configured ceiling the concurrency rule returns to
    # KV pool size (nanokv.gateway.adaptive.pool_rule); the byte limits (adaptive_pool_reserve_bytes,
    # adaptive_pool_margin_bytes) are the torch-side actuator's, built from the config by engine_glue
    pool_grow_fraction: float = 0.25  # one grow adds this fraction of the start-up size
    pool_high_usage: float = 0.9  # pressure: peak referenced blocks >= this x pool, with requests waiting
    pool_idle_usage: float = 0.5  # idle: peak referenced blocks < this x the start-up size, nothing waiting

    @classmethod
    def from_config(cls, cfg: Any) -> AdaptiveSettings:
        """From a validated nanokv.config.EngineConfig (duck-typed: no import of the config here)."""
        cands = cfg.policy_candidates
        return cls(mode=cfg.adaptive_mode, window_steps=cfg.adaptive_window_steps,
                   hit_rate_threshold=cfg.adaptive_hit_rate_threshold,
                   policy_switch_margin=cfg.adaptive_policy_switch_margin, policy_candidates=cands,
                   compression_error_bound=cfg.adaptive_compression_error_bound,
                   preemption_threshold=cfg.adaptive_preemption_threshold, max_num_seqs=cfg.max_num_seqs,
                   pool_grow_fraction=cfg.adaptive_pool_grow_fraction,
                   pool_high_usage=cfg.adaptive_pool_high_usage, pool_idle_usage=cfg.adaptive_pool_idle_usage)
