"""Where the hits above LRU are on multi-turn chat (docs/cache-policies.md, "The headroom").

On `conversation` seed 2 at 5 % capacity - the seed on which leaf_lru misses 1.15x LRU - leaf_lru
already takes what dead last blocks offer (an oracle that knows them exactly gets no more), the two
online probes of the conversations that ended lose to it (the turn-count probe, on geometric turns,
finds nothing to learn), and an oracle of those conversations holds the rest of Belady's headroom.
Where every conversation has the same number of turns (the `multi_turn` toy), the turn-count probe
does learn the end.
"""

from __future__ import annotations

import functools

import pytest
from nanokv_tools.sim.headroom import BUILDERS, main
from nanokv_tools.sim.replay import keys_of, replay
from nanokv_tools.sim.simulate import parse_capacities
from nanokv_tools.sim.traces import conversation, multi_turn
from nanokv_tools.sim.turn_probe import TurnEndProbe


@functools.cache
def _hits() -> dict[str, int]:
    reqs = conversation(512, seed=2)
    keys = keys_of(reqs)
    cap = parse_capacities("5%", len({h for r in reqs for h in r.hash_ids}))[0]
    hits = {p: replay(reqs, p, cap, keys=keys).block_hits for p in ("lru", "leaf_lru")}
    for name, build in BUILDERS.items():
        hits[name] = replay(reqs, name, cap, keys=keys, build=build).block_hits
    return hits


def test_leaf_lru_takes_what_dead_leaves_offer() -> None:
    h = _hits()
    assert h["leaf_lru"] >= 0.995 * h["dead_leaf_oracle"], h
    # ... and knowing the dead last blocks exactly is not enough for 1.15x LRU on this seed
    assert h["dead_leaf_oracle"] < 1.15 * h["lru"], h


def test_the_rest_is_in_conversations_that_ended() -> None:
    h = _hits()
    assert h["ended_oracle"] >= 1.2 * h["lru"], h
    assert h["ended_oracle"] >= h["leaf_lru"] + 0.1 * h["lru"], h


@pytest.mark.parametrize("probe", ["probe_reused", "probe_idle_gap"])
def test_online_end_predictors_lose_to_leaf_lru(probe: str) -> None:
    h = _hits()
    assert h[probe] < h["leaf_lru"], h


def test_turn_count_says_nothing_when_turns_are_geometric() -> None:
    h = _hits()
    assert abs(h["probe_turn"] - h["leaf_lru"]) <= 0.002 * h["lru"], h
    assert h["probe_turn"] < 1.15 * h["lru"], h


def test_turn_probe_learns_a_fixed_turn_count() -> None:
    """Six turns per conversation: the sixth is never continued, and only that class is judged dead."""
    reqs = multi_turn(512, seed=2)
    keys = keys_of(reqs)
    cap = parse_capacities("10%", len({h for r in reqs for h in r.hash_ids}))[0]
    probes: list[TurnEndProbe] = []

    def build(c: int, _next_use: object) -> TurnEndProbe:
        probes.append(TurnEndProbe(c))
        return probes[0]

    got = replay(reqs, "probe_turn", cap, keys=keys, build=build)
    leaf = replay(reqs, "leaf_lru", cap, keys=keys)
    probe = probes[0]
    assert [c for c, dead in enumerate(probe.turn_dead) if dead] == [6]
    assert probe.turn_continued[6] <= 0.05 * probe.turn_trials[6]
    assert min(probe.turn_continued[c] / probe.turn_trials[c] for c in (2, 3, 4)) >= 0.15
    assert probe.demoted > 0 and got.block_hits >= 1.02 * leaf.block_hits, (got.block_hits, leaf.block_hits)


def test_oracles_never_lose_to_lru_on_a_short_chat() -> None:
    reqs = conversation(512, minutes=10, seed=5)
    keys = keys_of(reqs)
    for cap in (40, 160):
        lru = replay(reqs, "lru", cap, keys=keys)
        for name in ("dead_leaf_oracle", "ended_oracle"):
            got = replay(reqs, name, cap, keys=keys, build=BUILDERS[name])
            assert got.block_hits >= lru.block_hits, (name, cap)
            assert got.block_total == lru.block_total


def test_cli_rejects_unknown_workloads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workloads", "conversation,chess"]) == 2
    err = capsys.readouterr().err
    assert "--workloads" in err and "chess" in err and "long_conversation" in err
