"""KV pool grow / shrink without torch: the block pool's bookkeeping (KVCacheManager.resize), the
pool rule's hysteresis, and the controller in act / recommend mode with a fake actuator. Engine
tests (real tensors, greedy equality) are in test_adaptive_pool.py."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest

from nanokv.cache_service.manager import KVCacheManager
from nanokv.cache_service.policies import ONLINE_POLICY_NAMES
from nanokv.errors import NanoKVError
from nanokv.gateway.adaptive import AdaptiveController, AdaptiveSettings
from nanokv.gateway.adaptive.pool_rule import PoolRule
from nanokv.gateway.adaptive.settings import PATIENCE_WINDOWS
from nanokv.gateway.adaptive.window import WindowStats

BS = 4


def run_prompt(cm: KVCacheManager, sid: object, tokens: list[int]) -> list[int]:
    table = cm.allocate(sid, len(tokens), cm.match_prefix(tokens))
    assert table is not None
    cm.cache_blocks(sid, tokens, len(tokens))
    return table


def check_invariants(cm: KVCacheManager) -> None:
    """Every block id in exactly one state; the counters agree with the arrays."""
    pool = cm.pool
    n = cm.num_blocks
    assert pool.num_blocks == n == len(pool.ref) == len(pool.hash) == len(pool.depth)
    free = set(pool.free)
    assert len(free) == len(pool.free) and all(0 <= b < n for b in free)
    used = {b for b in range(n) if pool.ref[b] > 0}
    cached_idle = {b for b in range(n) if pool.ref[b] == 0 and pool.hash[b] is not None}
    assert free.isdisjoint(used | cached_idle) and free | used | cached_idle == set(range(n))
    assert pool.num_used == len(used) and pool.num_evictable == len(cached_idle) == len(pool.policy)
    assert all(pool.hash[b] == h for h, b in pool.index.items())


def test_grow_appends_free_ids_used_after_the_old_free_ones() -> None:
    cm = KVCacheManager(4, BS, eviction_policy="lru")
    a = run_prompt(cm, "a", list(range(8)))  # 2 blocks
    assert cm.resize(7) == 7 and cm.num_blocks == 7 and cm.num_free_blocks() == 5
    check_invariants(cm)
    b = run_prompt(cm, "b", list(range(100, 120)))  # 5 blocks: the 2 old free ones first, then 4, 5, 6
    assert b == [2, 3, 4, 5, 6] and a == [0, 1]
    assert cm.usage() == 1.0
    check_invariants(cm)


def test_shrink_evicts_cached_high_blocks_and_never_touches_referenced_ones() -> None:
    cm = KVCacheManager(4, BS, eviction_policy="clock")
    cm.resize(10)
    run_prompt(cm, "a", list(range(20)))  # blocks 0..4, cached
    cm.free("a")
    hold = run_prompt(cm, "b", list(range(200, 228)))  # 7 blocks: 5..9 fresh, then 2 evicted from a's
    assert max(hold) == 9
    evictions = cm.stats.evictions
    assert cm.resize(4) == 10  # block 9 is referenced: nothing above it can go
    check_invariants(cm)
    cm.free("b")
    cached_high = [b for b in range(4, 10) if cm.pool.hash[b] is not None]
    assert cached_high and cm.resize(4) == 4
    assert cm.stats.evictions == evictions + len(cached_high)  # the normal eviction bookkeeping
    assert all(b < 4 for b in cm.pool.index.values())
    check_invariants(cm)
    assert cm.num_free_blocks() == 4 and cm.num_used_blocks() == 0


def test_shrink_stops_at_the_highest_referenced_block() -> None:
    cm = KVCacheManager(4, BS, eviction_policy="lru")
    cm.resize(8)
    run_prompt(cm, "x", list(range(24)))  # 6 blocks: 0..5
    cm.free("x")
    t = run_prompt(cm, "y", list(range(0, 12)) + [999])  # prefix hit on 0..2, one new block
    assert t[:3] == [0, 1, 2]
    assert cm.resize(2) == max(t) + 1  # stops right above y's highest block
    check_invariants(cm)
    # the prefix still hits after the shrink, on the kept blocks
    m = cm.match_prefix(list(range(12)) + [5])
    assert m.block_ids == [0, 1, 2]
    cm.free("y")


@pytest.mark.parametrize("policy", ONLINE_POLICY_NAMES)
def test_random_resizes_keep_every_policy_consistent(policy: str) -> None:
    rng = random.Random(1)
    cm = KVCacheManager(16, BS, eviction_policy=policy)
    live: set[int] = set()
    for step in range(400):
        r = rng.random()
        if r < 0.45:
            root = rng.randrange(6)  # shared prefixes: hits, pins of cached blocks
            toks = [root] * 8 + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
            m = cm.match_prefix(toks)
            if cm.allocate(step, len(toks), m) is not None:
                cm.cache_blocks(step, toks, len(toks))
                live.add(step)
        elif r < 0.8 and live:
            sid = rng.choice(sorted(live))
            live.discard(sid)
            cm.free(sid)
        else:
            target = rng.randrange(4, 40)
            got = cm.resize(target)
            assert got == cm.num_blocks and (got == target if target >= got else got == max(
                target, cm.pool.shrink_floor()))
        check_invariants(cm)
    for sid in list(live):
        cm.free(sid)
    assert cm.num_used_blocks() == 0 and cm.num_free_blocks() == cm.num_blocks  # no leaks
    with pytest.raises(NanoKVError, match="num_blocks"):
        cm.resize(0)


# ---- the rule ------------------------------------------------------------------------------------
S = AdaptiveSettings(window_steps=4, pool_grow_fraction=0.5, pool_high_usage=0.9, pool_idle_usage=0.5)


def win(used: int, blocks: int, waiting: float = 0.0, preemptions: int = 0) -> WindowStats:
    return WindowStats(0, 4, 0, 0, 0, 0, 100, preemptions, 4, waiting, used, blocks)


def never() -> int:
    raise AssertionError("not asked")


def test_rule_grows_on_pressure_within_headroom_only() -> None:
    rule = PoolRule(S)
    p = rule.evaluate(win(10, 10, waiting=2), 10, 10, lambda: 100, never)
    assert p is not None and p.kind == "pool_grow" and p.target == 15 and "requests waiting" in p.reason
    p = rule.evaluate(win(3, 15, preemptions=2), 15, 10, lambda: 2, never)  # capped by memory
    assert p is not None and p.target == 17 and "2 preemptions" in p.reason
    assert rule.evaluate(win(17, 17, waiting=1), 17, 10, lambda: 0, never) is None  # reserve spent
    assert rule.evaluate(win(17, 17, waiting=0), 17, 10, never, never) is None  # full but nobody waits
    assert rule.evaluate(win(8, 10, waiting=3), 10, 10, never, never) is None  # below the high mark


def test_rule_shrinks_after_patience_and_never_flaps_under_steady_load() -> None:
    rule = PoolRule(S)
    # steady load on a grown pool: used blocks between the idle and the high marks: nothing, ever
    assert all(rule.evaluate(win(12, 20, waiting=0), 20, 10, never, never) is None for _ in range(20))
    got = [rule.evaluate(win(2, 20), 20, 10, never, lambda: 3) for _ in range(PATIENCE_WINDOWS)]
    assert got[:-1] == [None] * (PATIENCE_WINDOWS - 1)
    p = got[-1]
    assert p is not None and p.kind == "pool_shrink" and p.target == 10 and "idle for 2 windows" in p.reason
    # a busy window in between restarts the count; the floor from live sequences is respected
    rule.evaluate(win(2, 20), 20, 10, never, never)
    rule.evaluate(win(6, 20), 20, 10, never, never)  # 6 >= 0.5 x 10: not idle
    got = [rule.evaluate(win(2, 20), 20, 10, never, lambda: 14) for _ in range(PATIENCE_WINDOWS)]
    assert got[-1] is not None and got[-1].target == 14
    assert rule.evaluate(win(2, 10), 10, 10, never, never) is None  # at the start-up size: nothing


# ---- the controller with a fake actuator --------------------------------------------------------
class FakePool:
    def __init__(self, cm: KVCacheManager, room: int) -> None:
        self.cm, self.base_blocks, self.room = cm, cm.num_blocks, room
        self.calls: list[int] = []

    def headroom_blocks(self) -> int:
        return self.room - (self.cm.num_blocks - self.base_blocks)

    def resize(self, n: int) -> tuple[int, str]:
        self.calls.append(n)
        return self.cm.resize(n), ""


def drive(ctl: AdaptiveController, cm: KVCacheManager, sched: SimpleNamespace, windows: int, used: int | None,
          waiting: int) -> None:
    """Hold ``used`` blocks (None: the whole pool) and ``waiting`` queued requests for ``windows`` windows."""
    for _ in range(windows):
        n = cm.num_blocks if used is None else used
        if n:
            run_prompt(cm, "load", list(range(1000, 1000 + n * BS)))
        sched.waiting[:] = [object()] * waiting
        for _ in range(ctl.settings.window_steps):
            ctl.on_step()
        cm.free("load")  # (a no-op when nothing was held)


@pytest.mark.parametrize("mode", ["act", "recommend"])
def test_controller_grows_then_shrinks_and_counts(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    cm = KVCacheManager(8, BS, eviction_policy="lru")
    sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=4, num_preemptions=0)
    pool = FakePool(cm, room=8)
    s = AdaptiveSettings(mode=mode, window_steps=2, pool_grow_fraction=0.5)
    ctl = AdaptiveController(s, cache=cm, scheduler=sched, pool=pool, policy_rule=False, concurrency_rule=False)
    with caplog.at_level(logging.INFO, "nanokv.gateway.adaptive"):
        drive(ctl, cm, sched, 3, used=None, waiting=2)  # full pool, queue: 8 -> 12 -> 16, then no reserve
        if mode == "act":
            assert cm.num_blocks == 16 and pool.calls == [12, 16]
            assert ctl.counts["pool_grow"] == 2 and ctl.history[-1].num_blocks == 16
        # a 1-block request whose block has a grown-pool id would hold the pool at that size
        # (referenced blocks never move): idle here means nothing running
        drive(ctl, cm, sched, 2 * PATIENCE_WINDOWS, used=0, waiting=0)
    if mode == "recommend":
        assert cm.num_blocks == 8 and pool.calls == []  # nothing changes
        assert ctl.counts == {"pool_grow_recommended": 1, "pool_shrink_recommended": 0}
        return
    assert cm.num_blocks == 8 and pool.calls == [12, 16, 8]
    assert ctl.counts == {"pool_grow": 2, "pool_shrink": 1, "pool_grow_refused": 0, "pool_shrink_refused": 0}
    assert "adaptive pool_shrink applied" in caplog.text and "because idle for 2 windows" in caplog.text
    assert cm.num_used_blocks() == 0 and cm.num_free_blocks() == 8


@pytest.mark.parametrize(("key", "value"), [
    ("adaptive_pool_reserve_bytes", 0), ("adaptive_pool_reserve_bytes", 1.5), ("adaptive_pool_margin_bytes", -1),
    ("adaptive_pool_margin_bytes", None), ("adaptive_pool_grow_fraction", 0), ("adaptive_pool_grow_fraction", 5),
    ("adaptive_pool_high_usage", 1.2), ("adaptive_pool_idle_usage", True), ("adaptive_pool_idle_usage", 0.95),
])
def test_bad_pool_config_names_the_field(key: str, value: object) -> None:
    from nanokv.config import EngineConfig
    from nanokv.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        EngineConfig.from_kwargs(**{key: value})
    EngineConfig.from_kwargs(adaptive_pool_reserve_bytes=1 << 20, adaptive_pool_margin_bytes=0)  # fine


def test_server_engine_thread_ticks_the_controller_while_idle() -> None:
    """The async engine's thread calls Engine.tick_idle when it wakes without work, so idle windows
    close (and a grown pool can shrink) while no request arrives."""
    import asyncio

    from nanokv.gateway.http.async_engine import AsyncEngine

    class IdleEngine:
        ticks = 0
        ready = True  # (Engine: no recovery, attached in process)
        recovery = None

        def has_unfinished_requests(self) -> bool:
            return False

        def tick_idle(self) -> None:
            self.ticks += 1

        def stats(self) -> dict:
            return {}

    async def run() -> int:
        eng = IdleEngine()
        ae = AsyncEngine(eng, stats_interval_s=0.01)
        await ae.start()
        await asyncio.sleep(0.2)
        await ae.stop()
        return eng.ticks

    assert asyncio.run(run()) >= 3
