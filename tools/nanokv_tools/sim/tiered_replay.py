"""Replay a trace through L1 (the engine's KVCacheManager) and lower tiers (cache_service/tiers).

The replay model is ``replay.replay``'s, call for call, with the hierarchy's calls around it:

    match_prefix -> match_lower -> begin_load -> allocate -> cache_blocks -> finish_load -> free

A request's hits are the leading run of blocks held by some tier at arrival: L1's run, then the
run the lower tiers continue. With no lower tier the result equals ``replay``'s (a test checks it).
Lower-tier sizes are byte budgets (``TierSpec.budget``): "4x" = 4 times L1's bytes, "20%" = the
bytes of 20% of the trace's unique blocks in L1's format, "12GiB"/"512MiB", or a plain block count
of L1's format; a narrower format holds more blocks in the same bytes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nanokv.cache_service.tiers.formats import KVShape, TierFormat, blocks_for_bytes, tier_format
from nanokv.cache_service.tiers.hierarchy import L1, TieredCache
from nanokv.cache_service.tiers.lower_tier import LowerTier
from nanokv.errors import NanoKVError
from nanokv_tools.sim.replay import NextUseOracle, admitted, keys_of, sim_manager
from nanokv_tools.sim.traces import TraceRequest

GIB = 1 << 30
_UNITS = {"GiB": GIB, "MiB": 1 << 20, "KiB": 1 << 10}


@dataclass(frozen=True)
class TierSpec:
    name: str  # "L2", "L3"
    budget: str  # see the module docstring
    policy: str = "lru"
    format: str = "bf16"
    keep_on_load: bool = False  # keep the copy as a replica after a load into L1 (hierarchy.py)


def budget_bytes(budget: str, *, l1_blocks: int, unique_blocks: int, l1_format: TierFormat, field_name: str) -> int:
    """A tier budget -> bytes (NanoKVError naming ``field_name`` when malformed)."""
    text = budget.strip()
    try:
        if text.endswith("x"):
            mult = float(text[:-1])
            if mult <= 0:
                raise ValueError
            return int(mult * l1_blocks * l1_format.bytes_per_block)
        if text.endswith("%"):
            frac = float(text[:-1]) / 100
            if frac <= 0:
                raise ValueError
            return int(frac * unique_blocks * l1_format.bytes_per_block)
        for unit, scale in _UNITS.items():
            if text.endswith(unit):
                v = float(text[: -len(unit)])
                if v <= 0:
                    raise ValueError
                return int(v * scale)
        n = int(text)
        if n < 1:
            raise ValueError
        return n * l1_format.bytes_per_block
    except ValueError:
        raise NanoKVError(field_name, f"got {budget!r}; give Nx (times L1's bytes), N% (of unique blocks), "
                                      "N GiB/MiB/KiB, or a positive block count") from None


@dataclass
class TieredResult:
    l1_policy: str
    l1_capacity: int
    tiers: list[dict[str, Any]]  # name, policy, format, capacity (blocks), bytes
    block_total: int
    token_total: int
    hit_blocks: dict[str, int]  # per level
    hit_tokens: dict[str, int]
    counters: dict[str, dict[str, int]]  # HierarchyStats' other tables
    total_bytes: int  # every level's capacity in bytes
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def block_hit_ratio(self) -> float:
        return sum(self.hit_blocks.values()) / self.block_total if self.block_total else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return sum(self.hit_tokens.values()) / self.token_total if self.token_total else 0.0

    def level_ratios(self) -> dict[str, float]:
        t = self.block_total or 1
        return {k: v / t for k, v in self.hit_blocks.items()}

    @property
    def hits_per_gib(self) -> float:
        """Block hit ratio per GiB of cache (all levels' bytes)."""
        return self.block_hit_ratio / (self.total_bytes / GIB) if self.total_bytes else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"l1_policy": self.l1_policy, "l1_capacity": self.l1_capacity, "tiers": self.tiers,
                "block_total": self.block_total, "token_total": self.token_total,
                "hit_blocks": self.hit_blocks, "hit_tokens": self.hit_tokens, "counters": self.counters,
                "total_bytes": self.total_bytes, "block_hit_ratio": self.block_hit_ratio,
                "token_hit_ratio": self.token_hit_ratio, "level_block_hit_ratio": self.level_ratios(),
                "hit_ratio_per_gib": self.hits_per_gib, "seconds": self.seconds, **self.extra}


def build_tiers(specs: Sequence[TierSpec], *, l1_blocks: int, unique_blocks: int, shape: KVShape,
                l1_format: str = "bf16", oracle: NextUseOracle | None = None) -> list[LowerTier]:
    l1_fmt = tier_format(l1_format, shape)
    out = []
    for s in specs:
        fmt = tier_format(s.format, shape)
        nbytes = budget_bytes(s.budget, l1_blocks=l1_blocks, unique_blocks=unique_blocks, l1_format=l1_fmt,
                              field_name=f"{s.name.lower()} budget")
        blocks = blocks_for_bytes(nbytes, fmt)
        if blocks < 1:
            raise NanoKVError(f"{s.name.lower()} budget", f"{s.budget!r} holds no {s.format} block "
                                                          f"({fmt.bytes_per_block} bytes each)")
        kw: dict[str, Any] = {"oracle": oracle} if s.policy == "belady" else {}
        out.append(LowerTier(s.name, blocks, fmt, s.policy, kw, keep_on_load=s.keep_on_load))
    return out


def replay_tiered(requests: Sequence[TraceRequest], l1_policy: str, l1_capacity: int, specs: Sequence[TierSpec],
                  block_size: int = 512, *, shape: KVShape, l1_format: str = "bf16",
                  keys: Sequence[Sequence[bytes]] | None = None, unique_blocks: int | None = None,
                  check_every: int = 0) -> TieredResult:
    """``check_every`` > 0 runs ``check_invariants`` every that many requests (tests)."""
    t0 = time.perf_counter()
    keys = keys_of(requests) if keys is None else keys
    if unique_blocks is None:
        unique_blocks = len({h for r in requests for h in r.hash_ids})
    oracle = NextUseOracle(keys) if l1_policy == "belady" or any(s.policy == "belady" for s in specs) else None
    cm = sim_manager(l1_capacity, block_size, l1_policy, policy_kwargs={"oracle": oracle} if oracle else None)
    tiers = build_tiers(specs, l1_blocks=l1_capacity, unique_blocks=unique_blocks, shape=shape,
                        l1_format=l1_format, oracle=oracle)
    l1_fmt = tier_format(l1_format, shape)
    tc = TieredCache(cm, tiers, l1_format=l1_fmt)
    hit_tokens = dict.fromkeys(tc.names, 0)
    totals = [0, 0]
    for i, hashes, num_tokens, sizes in admitted(requests, keys, block_size, l1_capacity, oracle, totals):
        match = cm.match_prefix(range(num_tokens + 1), block_hashes=hashes)
        lm = tc.match_lower(match)
        tc.begin_load(lm)
        # (None cannot happen: nothing else is pinned between requests)
        if cm.allocate(i, num_tokens, match, lm.resident()) is None:
            raise RuntimeError(f"request {i}: {len(hashes)} blocks do not fit in {l1_capacity}")
        k = lm.start
        hit_tokens[L1] += sum(sizes[:k])
        for j, lvl in enumerate(lm.sources):
            hit_tokens[tc.names[lvl]] += sizes[k + j]
        cm.cache_blocks(i, range(num_tokens), num_tokens)
        tc.finish_load(lm)
        cm.free(i)
        if check_every and i % check_every == 0:
            check_invariants(tc)
    st = tc.stats
    # L1's evictions from the manager: the same count when lower tiers hear them (check_invariants), and
    # still counted without lower tiers (no hook then)
    counters = {"moved": st.moved, "handed_down": st.handed_down, "evictions": {**st.evictions, L1: cm.stats.evictions},
                "replica_dropped": st.replica_dropped, "dropped": st.dropped, "occupancy": tc.occupancy()}
    caps = tc.capacity_bytes() or {}
    tiers_doc = [{"name": t.name, "policy": t.policy_name, "format": t.format.name, "capacity": t.capacity,
                  "bytes": t.capacity_bytes(), "keep_on_load": t.keep_on_load} for t in tiers]
    b_total, t_total = totals
    return TieredResult(l1_policy, l1_capacity, tiers_doc, b_total, t_total, dict(st.hit_blocks),
                        hit_tokens, counters, sum(caps.values()), time.perf_counter() - t0)


def check_invariants(tc: TieredCache) -> None:
    """Accounting the hierarchy must keep (AssertionError otherwise), O(resident blocks):
    occupancy within capacity; L1's cached blocks are its index; each level's victims are exactly
    those written or handed down, dropped as replicas, or dropped; a lower copy is either the block's
    owner or a replica of a block some higher level holds."""
    st = tc.stats
    pool = tc.manager.pool
    assert len(pool.index) <= pool.num_blocks
    assert st.evictions[L1] == pool.evictions, (st.evictions[L1], pool.evictions)
    for t in tc.tiers:
        assert len(t) <= t.capacity, (t.name, len(t), t.capacity)
        assert t.admitted - t.evictions - t.discarded == len(t), (t.name, t.admitted, t.evictions, len(t))
        assert st.evictions[t.name] == t.evictions
        written = sum(v for k, v in st.moved.items() if k.endswith(f"->{t.name}"))
        assert written == t.admitted, (t.name, written, t.admitted)
    for lvl, src in enumerate(tc.names):
        out = sum(v for k, v in (*st.moved.items(), *st.handed_down.items()) if k.startswith(f"{src}->")
                  and tc.names.index(k.split("->")[1]) > lvl)
        assert st.evictions[src] == out + st.replica_dropped[src] + st.dropped[src], src
    for lvl, t in enumerate(tc.tiers, 1):
        for h in t.keys():
            owner = tc.owner(h)
            assert owner is not None and tc.names.index(owner) <= lvl
