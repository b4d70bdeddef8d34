"""Which full blocks a sequence keeps under block sparsity: one ranking rule per policy, one budget.

Pure Python (no torch): the engine, the eval harness and the unit tests share it.

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
  attention  the highest accumulated attention mass (H2O-like; see nanokv.compute_service.sparsity.probe);
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

POLICIES = ("streaming", "interval", "attention", "hybrid")
SCORE_MODES = ("max", "sum")
_EPS = 1e-9  # float slack for the stride pattern (e.g. 3 * (1 - 0.7))


@dataclass(frozen=True)
class SparsityParams:
    sparsity: float  # s in [0, 1)
    policy: str = "streaming"
    # first blocks always kept: attention sinks (StreamingLLM keeps 4 tokens) and, at 4 blocks
    # (64 tokens), the start of the prompt where instructions usually are
    sink_blocks: int = 4
    # last full blocks always kept: 32 blocks (512 tokens at block size 16), half the budget of a 2k-token
    # sequence at s = 0.5, H2O's split (development screening on 2k-token windows, not in the docs: a
    # 4-block window cost about 3x the PPL of a 32-block one)
    recent_blocks: int = 32
    # blocks kept by the policy's ranking beyond the protected ones, whatever the budget: without them
    # a sequence whose budget is below the protected set (1,024 tokens at s = 0.5) keeps only sinks
    # and the recent window, and every policy degenerates to streaming
    min_ranked: int = 8
    # attention / hybrid: how per-step attention mass accumulates per block. "max": the largest mass
    # one query gave the block (a needle read by one query keeps its score; a sum favours blocks
    # every query glances at, e.g. the sinks); "sum": H2O's total.
    score_mode: str = "max"
    # hybrid, in the engine: slots of the INT4 demotion store as a fraction of the int8 pool's blocks
    # at start-up, allocated next to the pool (a pool resize leaves the store as it is). A slot takes
    # 0.55 of an int8 block's bytes (D = 64), so 0.5 costs ~27% more KV memory. At s = 0.5 and the
    # default protected set a 2k-token sequence holds ~0.3 demoted blocks per int8 one, tending to
    # s / (1 - s) for much longer ones. A full store leaves a block INT8, counted in
    # EngineSparsity.demotions_store_full. The eval (one sequence at a time) sizes it to the pool.
    store_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.sparsity) < 1.0:
            raise ValueError(f"sparsity must be in [0, 1), got {self.sparsity!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}; allowed: {', '.join(POLICIES)}")
        if self.score_mode not in SCORE_MODES:
            raise ValueError(f"score_mode {self.score_mode!r}; allowed: {', '.join(SCORE_MODES)}")
        if min(self.sink_blocks, self.recent_blocks, self.min_ranked) < 0:
            raise ValueError("sink_blocks, recent_blocks and min_ranked must be >= 0")
        if not 0.0 < float(self.store_fraction) <= 4.0:
            raise ValueError(f"store_fraction must be in (0, 4], got {self.store_fraction!r}")

    @property
    def needs_scores(self) -> bool:
        return self.policy in ("attention", "hybrid")

    @property
    def demotes(self) -> bool:
        return self.policy == "hybrid"


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
