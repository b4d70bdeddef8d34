"""``nanokv simulate --policies adaptive``: the controller replayed on traces (no torch).

On the phase-change workload (shared system prompts, then mostly long one-off documents, then
prompts again) the adaptive run must be within 1 point of the best static policy and beat the
engine's default (clock) and the policy it starts on (leaf_lru); on a steady workload it must not
flap; with no switch it is the plain replay of its start policy."""

from __future__ import annotations

import pytest
from nanokv_tools.sim import simulate
from nanokv_tools.sim.adaptive_replay import replay_adaptive
from nanokv_tools.sim.replay import keys_of, replay
from nanokv_tools.sim.traces import phase_change, shared_prompt

from nanokv.config import ADAPTIVE_START_POLICY
from nanokv.gateway.adaptive import AdaptiveSettings

STATIC = ("lru", "lru_k", "clock", "arc", "s3fifo", "sieve", "depth_lru", "leaf_lru")
CAPACITY = 257  # 0.6 % of the trace's 42,900 unique blocks: the prompts (288 blocks) do not all fit


@pytest.fixture(scope="module")
def trace():
    reqs = phase_change()
    return reqs, keys_of(reqs)


def test_phase_change_adaptive_beats_clock_and_tracks_the_best_static(trace):
    reqs, keys = trace
    static = {p: replay(reqs, p, CAPACITY, keys=keys).block_hit_ratio for p in STATIC}
    res, tl = replay_adaptive(reqs, CAPACITY, keys=keys)
    best = max(static.values())
    assert res.block_hit_ratio >= best - 0.01, (res.block_hit_ratio, static)
    assert res.block_hit_ratio > max(static["clock"], static[ADAPTIVE_START_POLICY]), (res.block_hit_ratio, static)
    start = tl.policy[0]
    assert tl.decisions and start == ADAPTIVE_START_POLICY == "leaf_lru" and tl.policy[-1] != start
    assert all("ghost hit ratios" in d.reason for d in tl.decisions)


def test_without_switching_it_is_the_plain_replay(trace):
    reqs, keys = trace
    reqs, keys = reqs[:900], keys[:900]
    frozen = AdaptiveSettings(policy_switch_margin=0.99)  # no ghost can ever lead by 99 points
    res, tl = replay_adaptive(reqs, 300, keys=keys, settings=frozen)
    ref = replay(reqs, ADAPTIVE_START_POLICY, 300, keys=keys)
    assert not tl.decisions
    assert (res.block_hits, res.token_hits, res.evictions) == (ref.block_hits, ref.token_hits, ref.evictions)


def test_steady_workload_does_not_flap():
    reqs = shared_prompt(groups=64, prompts_per_group=16)  # stationary: one distribution throughout
    s = AdaptiveSettings(window_steps=32)
    _, tl = replay_adaptive(reqs, 200, settings=s)
    steps = [d.step for d in tl.decisions]
    assert all(b - a >= s.window_steps for a, b in zip(steps, steps[1:]))
    assert len(steps) <= 2, [(d.step, d.action) for d in tl.decisions]  # settles
    visited = [p for i, p in enumerate(tl.policy) if i == 0 or p != tl.policy[i - 1]]
    assert len(visited) == len(set(visited)), visited  # never back to a policy it left: no A -> B -> A


def test_simulate_cli_accepts_adaptive(capsys):
    assert simulate.main(["--trace", "synthetic:phase_change", "--policies", "clock,adaptive", "--capacity",
                          "257", "--jobs", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "adaptive" in out and "clock" in out
    assert simulate.main(["--trace", "synthetic:rag", "--policies", "adaptiv", "--no-progress"]) == 2


def test_the_policy_controller_needs_no_torch():
    import subprocess
    import sys

    code = ("import sys; from nanokv_tools.sim import simulate; "
            "simulate.main(['--trace', 'synthetic:shared_prompt', '--policies', 'adaptive', '--capacity', '200', "
            "'--jobs', '1', '--no-progress']); assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
