"""``nanokv simulate --policies adaptive``: a trace replayed through one KVCacheManager whose
eviction policy the AdaptiveController switches, exactly as in the engine (same controller, same
ghosts, same rules). One request = one controller step, so ``window_steps`` counts requests here.

The replay model is nanokv_tools.sim.replay's: requests one at a time, match -> allocate -> cache ->
free; hits are the leading run of resident blocks; requests longer than the pool are cut to it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from nanokv.cache_service.ghosts import replay_request
from nanokv.cache_service.manager import KVCacheManager
from nanokv.config import ADAPTIVE_START_POLICY
from nanokv.gateway.adaptive.controller import AdaptiveController, Decision
from nanokv.gateway.adaptive.settings import AdaptiveSettings
from nanokv_tools.sim.replay import ReplayResult, block_tokens, keys_of
from nanokv_tools.sim.traces import TraceRequest

INITIAL_POLICY = ADAPTIVE_START_POLICY  # eviction_policy="adaptive" starts here and moves when it pays


@dataclass
class Timeline:
    """Per window: last request index, live block hit ratio (and its hits / blocks), active policy."""

    window: int
    ends: list[int] = field(default_factory=list)
    hit_ratio: list[float] = field(default_factory=list)
    hit_blocks: list[int] = field(default_factory=list)
    total_blocks: list[int] = field(default_factory=list)
    policy: list[str] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)


def replay_adaptive(
    requests: Sequence[TraceRequest],
    capacity: int,
    block_size: int = 512,
    *,
    settings: AdaptiveSettings | None = None,
    lru_k: int = 2,
    keys: Sequence[Sequence[bytes]] | None = None,
    initial_policy: str = INITIAL_POLICY,
    adapt: bool = True,
) -> tuple[ReplayResult, Timeline]:
    """``adapt=False`` replays the same loop with the policy fixed (a static baseline whose
    timeline is comparable window by window)."""
    t0 = time.perf_counter()
    s = settings or AdaptiveSettings()
    keys = keys_of(requests) if keys is None else keys
    cm = KVCacheManager(capacity, block_size, eviction_policy=initial_policy, lru_k=lru_k)
    ctl = AdaptiveController(s, cache=cm, concurrency_rule=False) if adapt else None
    tl = Timeline(s.window_steps)
    b_hits = b_total = t_hits = t_total = 0
    w_hits = w_total = 0
    for i, (req, hashes) in enumerate(zip(requests, keys)):
        sizes = block_tokens(req, block_size)
        b_total += len(sizes)
        t_total += sum(sizes)
        hashes = hashes[:capacity]
        if ctl is not None:
            ctl.observe_request(hashes)
        k = replay_request(cm, i, hashes)
        b_hits += k
        t_hits += sum(sizes[:k])
        w_hits += k
        w_total += len(sizes)
        if ctl is not None:
            tl.decisions.extend(ctl.on_step(computed_tokens=(len(hashes) - k) * block_size))
        if (i + 1) % s.window_steps == 0 or i + 1 == len(requests):
            tl.ends.append(i + 1)
            tl.hit_ratio.append(w_hits / w_total if w_total else 0.0)
            tl.hit_blocks.append(w_hits)
            tl.total_blocks.append(w_total)
            tl.policy.append(cm.policy_name)
            w_hits = w_total = 0
    name = "adaptive" if adapt else initial_policy
    result = ReplayResult(name, capacity, b_hits, b_total, t_hits, t_total, cm.stats.evictions,
                          time.perf_counter() - t0)
    return result, tl
