"""Block sparsity's settings, shared by the cache service (which decides) and the compute service
(which measures attention mass and holds the INT4 demotion store's tensors). Pure Python.

Three config keys, each read by both services and checked to agree at attach (nanokv.agreement):

  compression_sparsity  s in [0, 1): the fraction of a long sequence's full blocks that goes (0: off)
  sparsity_policy       streaming | interval | attention | hybrid (which blocks go first)
  sparsity_options      "name=value,..." of SparsityParams' knobs (sink_blocks, recent_blocks,
                        min_ranked, score_mode, store_fraction, probe_window); "" = their defaults

The budget rule and the policies: nanokv.cache_service.sparsity.policies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from nanokv.errors import ConfigError

POLICIES = ("streaming", "interval", "attention", "hybrid")
SCORE_MODES = ("max", "sum")
KNOBS = ("sink_blocks", "recent_blocks", "min_ranked", "score_mode", "store_fraction", "probe_window")


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
    # s / (1 - s) for much longer ones. A full store leaves a block INT8, counted in the cache
    # service's sparsity counters. The eval (one sequence at a time) sizes it to the pool.
    store_fraction: float = 0.5
    # attention / hybrid: the attention probe scores only the last probe_window queries of each prefill
    # row (SnapKV's observation window), 0 = every query. Its cost per prefill row and layer is one
    # reference attention pass over the row's queries; a window makes it that of probe_window queries.
    # 32 (SnapKV's window): on the GPU it lifted attention@0.5 from 0.61x to 1.27x int8's output tok/s
    # (docs/benchmarks.md); its quality against every query: docs/quality.md.
    probe_window: int = 32

    def __post_init__(self) -> None:
        s = self.sparsity
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 <= float(s) < 1.0:
            raise ValueError(f"sparsity must be a number in [0, 1), got {s!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}; allowed: {', '.join(POLICIES)}")
        if self.score_mode not in SCORE_MODES:
            raise ValueError(f"score_mode {self.score_mode!r}; allowed: {', '.join(SCORE_MODES)}")
        for name in ("sink_blocks", "recent_blocks", "min_ranked", "probe_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        f = self.store_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < float(f) <= 4.0:
            raise ValueError(f"store_fraction must be in (0, 4], got {f!r}")

    @property
    def needs_scores(self) -> bool:
        return self.policy in ("attention", "hybrid")

    @property
    def demotes(self) -> bool:
        return self.policy == "hybrid"

    def describe(self) -> str:
        """Every setting in one canonical line (what two services compare at attach), e.g.
        "streaming@0.5 (sink_blocks=4, recent_blocks=32, min_ranked=8, score_mode='max', store_fraction=0.5,
        probe_window=32)"."""
        knobs = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name in KNOBS)
        return f"{self.policy}@{float(self.sparsity):g} ({knobs})"


def full_rate_blocks(params: SparsityParams) -> int:
    """Full blocks from which a sequence drops exactly the fraction s: below it the budget's floor (sinks +
    recent window + min_ranked blocks, always kept) keeps more (nanokv.cache_service.sparsity.policies)."""
    floor = params.sink_blocks + params.recent_blocks + params.min_ranked
    return math.ceil(floor / (1.0 - params.sparsity) - 1e-9)


def budget_help(block_size: int = 16) -> str:
    """The budget rule in one sentence for the flags that set s, its numbers from the defaults above."""
    d = SparsityParams(0.5)
    n = full_rate_blocks(d)
    return (f"s is the fraction of a sequence's full KV blocks dropped (hybrid drops as many and demotes the "
            f"lowest-ranked s of the kept unprotected ones to INT4); the first {d.sink_blocks} and last "
            f"{d.recent_blocks} blocks and {d.min_ranked} ranked ones are always kept (defaults), so s is reached "
            f"only from {d.sink_blocks + d.recent_blocks + d.min_ranked}/(1-s) full blocks on: at s=0.5 from {n} "
            f"blocks = {n * block_size:,} tokens at block size {block_size}; shorter sequences drop less "
            f"(docs/quality.md)")


def demotion_slots(params: SparsityParams, num_blocks: int) -> int:
    """Slots of the INT4 demotion store for a pool of `num_blocks` (hybrid): both services size it
    by this rule from the same settings, the compute service its tensors, the cache service its free list."""
    return max(1, math.ceil(params.store_fraction * num_blocks)) if params.demotes else 0


def parse_options(text: str) -> dict[str, Any]:
    """sparsity_options "sink_blocks=1,recent_blocks=4,score_mode=sum" -> the knobs (typed);
    ConfigError naming sparsity_options on a bad one."""
    if not isinstance(text, str):
        raise ConfigError("sparsity_options", f"got {text!r}; a string 'name=value,...' of {', '.join(KNOBS)}, "
                                              "or '' (the defaults)")
    out: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, eq, value = (x.strip() for x in part.partition("="))
        if not eq or name not in KNOBS:
            raise ConfigError("sparsity_options", f"got {part!r}; want name=value with name one of {', '.join(KNOBS)}")
        try:
            out[name] = value if name == "score_mode" else float(value) if name == "store_fraction" else int(value)
        except ValueError:
            want = "a number" if name == "store_fraction" else "an integer"
            raise ConfigError("sparsity_options", f"{name}: got {value!r}; want {want}") from None
    return out


def params_of(cfg: Any) -> SparsityParams | None:
    """The settings of a config with compression_sparsity, sparsity_policy and sparsity_options
    (a CacheConfig or ComputeConfig), or None when sparsity is off (s = 0). ConfigError names the field."""
    s = cfg.compression_sparsity
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 <= float(s) < 1.0:
        raise ConfigError("compression_sparsity", f"got {s!r}; must be a number in [0, 1)")
    if cfg.sparsity_policy not in POLICIES:
        raise ConfigError("sparsity_policy", f"got {cfg.sparsity_policy!r}; allowed values: {', '.join(POLICIES)}")
    knobs = parse_options(cfg.sparsity_options)
    try:
        params = SparsityParams(float(s), cfg.sparsity_policy, **knobs)
    except ValueError as e:
        raise ConfigError("sparsity_options", str(e)) from None
    return params if params.sparsity > 0.0 else None


def slot_code(slot: int) -> int:
    """The block-table entry naming slot `slot` of the INT4 demotion store (-1 is a hole)."""
    return -2 - slot


def code_slot(entry: int) -> int:
    """The demotion-store slot a block-table entry (<= -2) names."""
    return -2 - entry
