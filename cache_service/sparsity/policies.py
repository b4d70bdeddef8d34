"""Which full blocks a sequence keeps under block sparsity: one ranking rule per policy, one budget.

Pure Python (no torch): the cache service (nanokv.cache_service.sparsity.decide), the eval harness
and the unit tests share it. The settings (SparsityParams) live in nanokv.sparsity.

The budget is the same for every policy. With s = compression_sparsity and n the sequence's full
blocks (the open tail block is never a candidate):

    live full blocks after a step = max(live protected blocks + min_ranked, ceil((1 - s) * n))

(never more than n) where the protected blocks are the first `sink_blocks` (attention sinks) and
the last `recent_blocks` full blocks. Short sequences thus drop less than s; from
n >= (sinks + recent + min_ranked) / (1 - s) on, exactly the fraction s goes. A policy only says
which of the other live blocks to keep first (at least `min_ranked` of them):

  streaming  the most recent ones (StreamingLLM: sinks + a recent window);
  interval   those on a fixed stride pattern of rate (1 - s) (block i is on it when
             floor((i + 1)(1 - s)) > floor(i (1 - s))), newest first among equals;
  attention  the highest accumulated attention mass (H2O-like; measured by nanokv.compute_service.sparsity.probe);
  hybrid     as attention, and of the kept non-protected blocks the lowest-ranked fraction s is
             demoted INT8 -> INT4 (moved into the INT4 demotion store, nanokv.kv.demote): by rank,
             the top tier stays INT8, the middle tier is INT4, the bottom tier is dropped
             ((1-s)^2, s(1-s), s of the candidates).

Dropped blocks never come back and demoted blocks are never promoted: the caller only ever
passes live blocks, so a plan is monotone over a sequence's life.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from nanokv.sparsity import POLICIES, SparsityParams

_EPS = 1e-9  # float slack for the stride pattern (e.g. 3 * (1 - 0.7))

__all__ = ["POLICIES", "Plan", "SparsityParams", "keep_budget", "on_interval_grid", "plan", "protected"]


@dataclass
class Plan:
    drop: list[int] = field(default_factory=list)  # logical block indices to release now
    demote: list[int] = field(default_factory=list)  # logical block indices to move to INT4 (kv.demote)

    def __bool__(self) -> bool:
        return bool(self.drop or self.demote)


def keep_budget(n_full: int, sparsity: float) -> int:
    """Full blocks a sequence may keep: ceil((1 - s) * n_full)."""
    return math.ceil((1.0 - sparsity) * n_full - _EPS)


def protected(n_full: int, p: SparsityParams) -> set[int]:
    """Logical indices never dropped: sinks and the recent window of full blocks."""
    return set(range(min(p.sink_blocks, n_full))) | set(range(max(0, n_full - p.recent_blocks), n_full))


def on_interval_grid(i: int, sparsity: float) -> bool:
    """Fixed-interval pattern keeping a fraction (1 - s) of blocks, evenly spread (Bresenham)."""
    keep = 1.0 - sparsity
    return math.floor((i + 1) * keep + _EPS) > math.floor(i * keep + _EPS)


def rank_key(p: SparsityParams, i: int, score: float) -> tuple[float, ...]:
    """Sort key of candidate block i: larger = kept first (ties: the newer block wins)."""
    if p.policy == "streaming":
        return (float(i),)
    if p.policy == "interval":
        return (float(on_interval_grid(i, p.sparsity)), float(i))
    return (score, float(i))


def plan(p: SparsityParams, n_full: int, live: Sequence[int], scores: Sequence[float],
         demoted: set[int] | frozenset[int] = frozenset()) -> Plan:
    """live: logical indices of the live full blocks (< n_full); scores[i]: block i's accumulated
    attention mass (attention/hybrid; ignored otherwise); demoted: blocks already INT4."""
    out = Plan()
    if p.sparsity <= 0.0 or n_full <= 0:
        return out
    prot = protected(n_full, p)
    cands = [i for i in live if i not in prot]
    n_prot_live = len(live) - len(cands)
    n_keep = max(p.min_ranked, keep_budget(n_full, p.sparsity) - n_prot_live)
    cands.sort(key=lambda i: rank_key(p, i, scores[i] if i < len(scores) else 0.0), reverse=True)
    kept, out.drop = cands[:n_keep], sorted(cands[n_keep:])
    if p.demotes:
        n_int8 = keep_budget(len(kept), p.sparsity)  # the top (1 - s) of the kept stay INT8
        out.demote = sorted(i for i in kept[n_int8:] if i not in demoted)
    return out
