"""The policy claims of docs/cache-policies.md on the seeded workloads (issue #38).

* leaf_lru is never below LRU on any workload at 1 / 5 / 10 / 25 % capacity (the Mooncake trace:
  tests/tools/test_cache_simulate.py), and >= 1.15x LRU at 5 % on multi-turn chat - on four of five
  seeds; on seed 2 it is 1.11x, and no online policy can reach 1.15x there
  (tests/tools/test_cache_headroom.py);
* the workload generators are deterministic and match the statistics they are calibrated to;
* the adaptive controller, starting on leaf_lru, stays within 2 % of the best static policy on the
  phase-change workloads and never below LRU.
"""

from __future__ import annotations

import functools

import pytest
from nanokv_tools.sim.adaptive_replay import replay_adaptive
from nanokv_tools.sim.replay import ideal, keys_of, replay
from nanokv_tools.sim.simulate import ADAPTIVE_CANDIDATES, ADAPTIVE_INITIAL, parse_capacities
from nanokv_tools.sim.suite import WORKLOADS
from nanokv_tools.sim.traces import SYNTHETIC, conversation, tool_agent

from nanokv.cache_service.policies import ONLINE_POLICY_NAMES
from nanokv.gateway.adaptive.settings import AdaptiveSettings

PCTS = (1, 5, 10, 25)


@functools.cache
def _trace(name: str) -> tuple[list, list, list[int]]:
    reqs = SYNTHETIC[name](512)
    unique = len({h for r in reqs for h in r.hash_ids})
    return reqs, keys_of(reqs), parse_capacities(",".join(f"{p}%" for p in PCTS), unique)


@pytest.mark.parametrize("name", WORKLOADS)
def test_leaf_lru_is_never_below_lru(name: str) -> None:
    reqs, keys, caps = _trace(name)
    for cap in caps:
        lru, ours = replay(reqs, "lru", cap, keys=keys), replay(reqs, "leaf_lru", cap, keys=keys)
        assert ours.block_hits >= lru.block_hits, (name, cap, ours.block_hit_ratio, lru.block_hit_ratio)
        assert ours.token_hits >= lru.token_hits, (name, cap)


def test_leaf_lru_is_at_least_1_15x_lru_at_5_percent_on_multi_turn_chat() -> None:
    reqs, keys, caps = _trace("conversation")
    lru, ours = replay(reqs, "lru", caps[1], keys=keys), replay(reqs, "leaf_lru", caps[1], keys=keys)
    assert ours.block_hit_ratio >= 1.15 * lru.block_hit_ratio, (ours.block_hit_ratio, lru.block_hit_ratio)
    # ... and the policies that assume a new block must prove itself quickly lose there (the caveats)
    for p in ("sieve", "s3fifo", "lru_k"):
        assert replay(reqs, p, caps[1], keys=keys).block_hits < lru.block_hits, p


@pytest.mark.parametrize("seed", range(5))
def test_leaf_lru_at_5_percent_over_five_seeds_of_both_chat_workloads(seed: int) -> None:
    # docs/cache-policies.md, "The headroom": 1.19 1.19 1.11 1.20 1.25 and 1.05 1.04 1.03 1.05 1.05
    for name, floor in (("conversation", 1.15 if seed != 2 else 1.10), ("long_conversation", 1.03)):
        reqs = SYNTHETIC[name](512, seed=seed)
        keys = keys_of(reqs)
        cap = parse_capacities("5%", len({h for r in reqs for h in r.hash_ids}))[0]
        lru, ours = replay(reqs, "lru", cap, keys=keys), replay(reqs, "leaf_lru", cap, keys=keys)
        assert ours.block_hit_ratio >= floor * lru.block_hit_ratio, (name, ours.block_hit_ratio, lru.block_hit_ratio)
        assert ours.token_hits >= lru.token_hits, name


def test_generators_are_deterministic_and_prefix_chained() -> None:
    a, b, c = conversation(minutes=5), conversation(minutes=5), conversation(minutes=5, seed=1)
    assert [(r.timestamp, r.hash_ids) for r in a] == [(r.timestamp, r.hash_ids) for r in b]
    assert [r.hash_ids for r in a] != [r.hash_ids for r in c]
    for reqs in (a, tool_agent(minutes=3), SYNTHETIC["mixed_phases"](512, minutes=3)):
        first: dict[int, tuple[int, ...]] = {}
        for r in reqs:
            assert len(r.hash_ids) == -(-r.input_length // 512)
            for i, h in enumerate(r.hash_ids):  # equal id at i <=> equal first i+1 ids
                assert first.setdefault(h, tuple(r.hash_ids[: i + 1])) == tuple(r.hash_ids[: i + 1])
        assert [r.timestamp for r in reqs] == sorted(r.timestamp for r in reqs)


def test_conversation_matches_its_calibration() -> None:
    reqs, _, _ = _trace("conversation")
    assert 11_000 < len(reqs) < 13_000  # Mooncake's conversation trace: 12,031 requests in an hour
    assert reqs[-1].timestamp - reqs[0].timestamp < 3_600_000
    out = sum(r.output_length for r in reqs) / len(reqs)
    assert 180 < out < 250  # LMSYS-Chat-1M: 214.5 tokens per answer
    assert 0.40 <= ideal(reqs)[0] <= 0.62  # Mooncake conversation 40%, Alibaba to-C 62%
    agents, _, _ = _trace("tool_agent")
    assert 10_500 < len(agents) < 13_000  # Mooncake tool&agent: 23,608 an hour; 30 minutes here


@functools.cache
def _static_best(name: str, cap: int) -> tuple[float, float]:
    reqs, keys, _ = _trace(name)
    ratios = {p: replay(reqs, p, cap, keys=keys).block_hit_ratio for p in ONLINE_POLICY_NAMES}
    return max(ratios.values()), ratios["lru"]


@pytest.mark.parametrize(("name", "pct"), [("mixed_phases", p) for p in PCTS] + [("phase_change", p) for p in PCTS])
def test_adaptive_tracks_the_best_static_policy_on_phase_changes(name: str, pct: int) -> None:
    reqs, keys, caps = _trace(name)
    cap = caps[PCTS.index(pct)]
    got, tl = replay_adaptive(reqs, cap, 512, keys=keys, initial_policy=ADAPTIVE_INITIAL,
                              settings=AdaptiveSettings(policy_candidates=ADAPTIVE_CANDIDATES))
    best, lru = _static_best(name, cap)
    assert got.block_hit_ratio >= lru, (got.block_hit_ratio, lru)
    # A switch starts warm (the new policy takes its ghost's history): without that, phase_change at
    # 1% missed by 2.04% (tests/cache_service/test_cache_policies_warm.py).
    assert got.block_hit_ratio >= 0.98 * best, (got.block_hit_ratio, best, [d.action for d in tl.decisions])
