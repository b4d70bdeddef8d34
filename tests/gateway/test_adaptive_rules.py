"""The adaptive controller's rules and bookkeeping, with hand-made windows (no torch, no model):
each rule fires on its evidence and only then, hysteresis holds near thresholds (no flapping:
at most one adaptation per rule per window), recommend mode only reports, every decision is
logged with its reason and counted."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from nanokv.cache_service.manager import KVCacheManager
from nanokv.gateway.adaptive import AdaptiveController, AdaptiveSettings
from nanokv.gateway.adaptive.rules import ConcurrencyRule, PolicyRule, PrecisionRule
from nanokv.gateway.adaptive.settings import PATIENCE_WINDOWS, alarm_z
from nanokv.gateway.adaptive.window import WindowStats
from nanokv.messages import GhostScores

S = AdaptiveSettings(window_steps=4, max_num_seqs=16)


def win(hits: int = 0, queries: int = 0, evictions: int = 0, preemptions: int = 0, peak: int = 8,
        waiting: float = 0.0) -> WindowStats:
    return WindowStats(0, 4, queries, hits, evictions, 0, 100, preemptions, peak, waiting)


# ---- eviction policy ---------------------------------------------------------------------------
def evidence(per_request: dict[str, list[int]], blocks_per_request: int = 5) -> GhostScores:
    """GhostScores from each ghost's hit blocks on the same requests."""
    names = list(per_request)
    n = len(per_request[names[0]])
    pairs = {(a, b): float(sum((x - y) ** 2 for x, y in zip(per_request[a], per_request[b])))
             for i, a in enumerate(names) for b in names[i + 1:]}
    return GhostScores({p: float(sum(h)) for p, h in per_request.items()}, float(n * blocks_per_request), pairs)


def both(ev: GhostScores) -> tuple[GhostScores, GhostScores]:
    return ev, ev  # (this window, recent): the same evidence for both horizons


TIED = both(evidence({"clock": [4] * 20, "lru_k": [4] * 20}))
LEAD = both(evidence({"clock": [2] * 20, "lru_k": [3] * 20}))  # 20 points, one block on every request


def test_policy_switches_at_once_when_hit_rate_falls_while_evictions_rise():
    rule = PolicyRule(S)
    assert rule.evaluate(win(90, 100, 10), TIED, "clock") is None
    p = rule.evaluate(win(40, 100, 50), LEAD, "clock")
    assert p is not None and p.target == "lru_k" and "falling 0.900 -> 0.400" in p.reason


def test_the_alarm_needs_a_stronger_lead_when_more_ghosts_compete():
    # the best of three alternatives, tested on one window, needs z >= 2.43 (alarm_z); of one, z >= 2.0
    assert abs(alarm_z(1) - 2.0) < 1e-9 and 2.42 < alarm_z(3) < 2.44
    lead = [3] * 10 + [1] * 2 + [2] * 8  # +1 block on ten requests, -1 on two: z = 8 / sqrt(12) = 2.31
    two = both(evidence({"clock": [2] * 20, "lru_k": lead}))
    four = both(evidence({"clock": [2] * 20, "lru_k": lead, "arc": [2] * 20, "s3fifo": [2] * 20}))
    falling = (win(90, 100, 10), win(40, 100, 50))
    rule = PolicyRule(S)
    assert rule.evaluate(falling[0], two, "clock") is None
    p = rule.evaluate(falling[1], two, "clock")
    assert p is not None and p.target == "lru_k" and "z = 2.3" in p.reason
    rule = PolicyRule(S)
    assert rule.evaluate(falling[0], four, "clock") is None
    # z = 2.31 comes by chance 1 % of the time for one ghost, 3 % for the best of three
    assert rule.evaluate(falling[1], four, "clock") is None


def test_policy_steady_regret_needs_patience_margin_and_significance():
    rule = PolicyRule(S)
    w = win(50, 100, 10)
    tiny = both(evidence({"clock": [2] * 200, "arc": [2] * 199 + [3]}))  # significant? no; 0.1 point anyway
    assert all(rule.evaluate(w, tiny, "clock") is None for _ in range(5))
    lucky = both(evidence({"clock": [2] * 20, "arc": [2] * 19 + [40]}))  # +38 points from one request
    assert all(rule.evaluate(w, lucky, "clock") is None for _ in range(5))
    got = [rule.evaluate(w, LEAD, "clock") for _ in range(PATIENCE_WINDOWS)]
    assert got[:-1] == [None] * (PATIENCE_WINDOWS - 1) and got[-1] is not None and got[-1].target == "lru_k"
    assert "z = 4.5" in got[-1].reason


def test_policy_moot_without_evictions_and_ties_keep_the_active_policy():
    rule = PolicyRule(S)
    for _ in range(5):
        assert rule.evaluate(win(10, 100, 0), LEAD, "clock") is None
        assert rule.evaluate(win(10, 100, 5), TIED, "clock") is None
        assert rule.evaluate(win(10, 100, 5), TIED, "lru_k") is None


# ---- max_num_seqs ------------------------------------------------------------------------------
def test_concurrency_lowers_on_preemptions_and_raises_only_after_quiet_windows_with_a_queue():
    rule = ConcurrencyRule(S)
    p = rule.evaluate(win(preemptions=3, peak=8), 16)
    assert p is not None and p.target == 6  # 0.75 x the peak batch that overran memory
    assert rule.evaluate(win(peak=6, waiting=0.0), 6) is None
    assert rule.evaluate(win(peak=6, waiting=0.0), 6) is None  # quiet, but nobody waits: no gain
    assert rule.evaluate(win(peak=6, waiting=3.0), 6) is not None  # quiet >= patience and a queue
    assert rule.evaluate(win(peak=6, waiting=3.0), 7) is None  # patience starts over
    assert rule.evaluate(win(preemptions=1, peak=1), 1) is None  # nothing lower than 1


# ---- KV bit width ------------------------------------------------------------------------------
def test_precision_widens_to_the_narrowest_safe_width_and_narrows_slowly():
    rule = PrecisionRule(S)  # bound 1.0
    p = rule.evaluate({3: {4: 3.5, 8: 0.4}, 5: {4: 0.3, 8: 0.02}}, [8, 8, 8, 4, 8, 4], [8, 8, 8, 4, 8, 4])
    assert p is not None and p.target == {3: 8}
    p = rule.evaluate({3: {4: 3.5, 8: 2.0}}, [8, 8, 8, 4], [8, 8, 8, 4])
    assert p is not None and p.target == {3: 16}  # int8 measured over the bound too: skip it
    p = rule.evaluate({1: {8: 1.5}}, [8, 8], [8, 8])
    assert p is not None and p.target == {1: 16}  # nothing measured in between
    # back: only after PATIENCE_WINDOWS windows under 0.5 x bound, one rung at a time, never below plan
    cur, base = [16, 8], [4, 8]
    got = [rule.evaluate({0: {4: 0.3, 8: 0.02}, 1: {8: 0.01}}, cur, base) for _ in range(PATIENCE_WINDOWS)]
    assert got[:-1] == [None] * (PATIENCE_WINDOWS - 1) and got[-1] is not None and got[-1].target == {0: 8}


def test_precision_does_not_flap_on_an_error_hovering_at_the_bound():
    rule = PrecisionRule(S)
    cur, base = [4], [4]
    changes = []
    for i in range(40):
        e = 1.05 if i % 2 == 0 else 0.95  # hovering around the bound of 1.0
        p = rule.evaluate({0: {4: e, 8: 0.1}}, cur, base)
        if p is not None:
            changes.append((i, p.target))
            cur = [p.target[0]]
    assert changes == [(0, {0: 8})]  # widened once; 0.95 is never "low" enough to come back


# ---- the controller ----------------------------------------------------------------------------
class FakeScheduler:
    def __init__(self, max_num_seqs: int = 16) -> None:
        self.max_num_seqs = max_num_seqs
        self.running: list[int] = list(range(8))
        self.waiting: list[int] = [1, 2]
        self.num_preemptions = 0


class FakePrecision:
    def __init__(self, errors: dict[int, dict[int, float]]) -> None:
        self.base_bits = [4, 4]
        self.bits = [4, 4]
        self.errors = errors

    def current_bits(self) -> list[int]:
        return list(self.bits)

    def window_errors(self) -> dict[int, dict[int, float]]:
        return self.errors

    def apply(self, changes: dict[int, int]) -> dict[int, str]:
        for i, b in changes.items():
            self.bits[i] = b
        return {}


def _decisions_per_window(ctl: AdaptiveController) -> None:
    steps: dict[str, list[int]] = {}
    for d in ctl.decisions:
        steps.setdefault(d.kind, []).append(d.step)
    for kind, s in steps.items():
        assert all(b - a >= ctl.settings.window_steps for a, b in zip(s, s[1:])), (kind, s)


def test_controller_acts_logs_and_counts_once_per_window(caplog):
    sched = FakeScheduler()
    prec = FakePrecision({1: {4: 3.0, 8: 0.1}})
    ctl = AdaptiveController(S, scheduler=sched, precision=prec)
    assert ctl.counts == {"max_num_seqs": 0, "kv_bits": 0, "kv_bits_refused": 0}
    with caplog.at_level(logging.INFO, logger="nanokv.gateway.adaptive"):
        for _ in range(40):  # steady pressure: a preemption on every step
            sched.num_preemptions += 1
            ctl.on_step()
    _decisions_per_window(ctl)
    assert prec.bits == [4, 8] and ctl.counts["kv_bits"] == 1
    # 16 -> 6 (0.75 x the peak batch of 8), then one step down per window, never twice in one
    assert sched.max_num_seqs == 1 and ctl.counts["max_num_seqs"] == 6
    assert [d.step for d in ctl.decisions if d.kind == "max_num_seqs"] == [4, 8, 12, 16, 20, 24]
    assert any("preemptions in the window" in r.getMessage() for r in caplog.records)
    assert any("error 3 at 4 bits > bound 1" in r.getMessage() for r in caplog.records)


def test_recommend_mode_only_reports_once_per_advice():
    cm = KVCacheManager(8, 4, eviction_policy="clock")
    sched = FakeScheduler()
    prec = FakePrecision({0: {4: 3.0, 8: 0.1}})
    ctl = AdaptiveController(AdaptiveSettings(mode="recommend", window_steps=2, max_num_seqs=16), cache=cm,
                             scheduler=sched, precision=prec)
    for _ in range(20):
        sched.num_preemptions += 1
        ctl.on_step()
    assert sched.max_num_seqs == 16 and prec.bits == [4, 4] and cm.policy_name == "clock"
    assert ctl.counts["max_num_seqs_recommended"] == 1 and ctl.counts["kv_bits_recommended"] == 1
    assert all(not d.applied and d.note == "recommend mode" for d in ctl.decisions)


def test_controller_reads_admissions_from_the_scheduler_output():
    cm = KVCacheManager(64, 4, eviction_policy="clock")
    ctl = AdaptiveController(S, cache=cm, concurrency_rule=False)
    seq = SimpleNamespace(seq_id=1, num_preemptions=0, prompt_token_ids=list(range(13)), cache_salt=None,
                          is_finished=False)
    out = SimpleNamespace(prefills=[SimpleNamespace(seq=seq)], num_tokens=13)
    ctl.on_step(out)
    ctl.on_step(out)  # a later chunk of the same prefill: not a second lookup
    assert ctl.ghosts is not None
    scores = ctl.ghosts.window_scores()
    assert scores is not None and scores[0].queries == 3  # (13 - 1) // 4 blocks, looked up once
