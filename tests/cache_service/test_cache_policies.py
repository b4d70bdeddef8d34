"""Hand-built micro traces with exactly known hits, one behaviour per policy.

Single-block requests go through the real manager (``replay``), so a hit is plain cache membership
and every policy sees exactly the calls the engine makes.
"""

from __future__ import annotations

import warnings

import pytest
from nanokv_tools.sim.replay import keys_of, replay
from nanokv_tools.sim.traces import TraceRequest, conversation, rag

from nanokv.cache_service import KVCacheManager, make_policy
from nanokv.cache_service.policies import CAVEATS, ONLINE_POLICY_NAMES, PolicyCaveatWarning
from nanokv.cache_service.policies import _warned as warned_policies
from nanokv.cache_service.policies.depth_lru import DepthLRUPolicy, _class_of
from nanokv.cache_service.policies.leaf_lru import BEFORE_LAST, INTERIOR, LAST, LeafLRUPolicy
from nanokv.errors import NanoKVError


def _trace(seq: str) -> list[TraceRequest]:
    return [TraceRequest(float(i), 512, 1, [ord(c)]) for i, c in enumerate(seq)]


def flags(policy: str, capacity: int, seq: str, **kw: object) -> list[int]:
    """Hit flag per request of ``seq`` (one letter = one single-block request)."""
    from nanokv_tools.sim.replay import NextUseOracle, keys_of

    trace = _trace(seq)
    keys = keys_of(trace)
    oracle = NextUseOracle(keys) if policy == "belady" else None
    pk = dict(kw, oracle=oracle) if oracle else dict(kw)
    cm = KVCacheManager(capacity, 4, eviction_policy=policy, policy_kwargs=pk)
    out = []
    for i, h in enumerate(keys):
        if oracle:
            oracle.now = i
        m = cm.match_prefix(range(5), block_hashes=h)
        assert cm.allocate(i, 4, m) is not None
        cm.cache_blocks(i, range(4), 4)
        cm.free(i)
        out.append(len(m.block_ids))
    return out


def test_lru_keeps_recent_clock_keeps_insertion_order() -> None:
    # After B then A are hit, LRU order is C,B,A; CLOCK's ring is still A,B,C (hits only set bits).
    # D evicts C in both; E then evicts B under LRU but A under CLOCK, so the final A differs.
    seq = "ABCBADEA"
    assert flags("lru", 3, seq) == [0, 0, 0, 1, 1, 0, 0, 1]
    assert flags("clock", 3, seq) == [0, 0, 0, 1, 1, 0, 0, 0]


def test_sieve_visited_bit_survives_the_hand() -> None:
    # A is hit once; SIEVE clears its bit but leaves it in place while new blocks churn past it.
    seq = "ABCADEFA"
    assert flags("sieve", 3, seq) == [0, 0, 0, 1, 0, 0, 0, 1]
    assert flags("lru", 3, seq) == [0, 0, 0, 1, 0, 0, 0, 0]


def test_arc_protects_frequent_blocks_from_a_scan_and_adapts() -> None:
    seq = "ABAB" + "CDEFGHIJ" + "AB"
    assert flags("arc", 4, seq)[-2:] == [1, 1]  # A, B live in T2; the scan only churns T1
    assert flags("lru", 4, seq)[-2:] == [0, 0]
    # A ghost hit in B1 (key evicted from T1 comes back) grows the recency target p.
    cm = KVCacheManager(2, 4, eviction_policy="arc")
    for i, c in enumerate("ABCA"):
        h = [bytes([ord(c)])]
        cm.allocate(i, 4, cm.match_prefix(range(5), block_hashes=h))
        cm.cache_blocks(i, range(4), 4)
        cm.free(i)
    assert cm.pool.policy.p > 0  # type: ignore[attr-defined]


def test_s3fifo_one_hit_wonders_leave_quickly_and_ghosts_return_to_main() -> None:
    # A is reused while in the small queue, so it is promoted to main; the one-hit scan drains
    # through the small queue and A survives. LRU loses it.
    seq = "AA" + "CDEFGHIJKLMN" + "A"
    assert flags("s3fifo", 10, seq)[-1] == 1
    assert flags("lru", 10, seq)[-1] == 0
    # A one-hit wonder evicted to the ghost queue and requested again is admitted straight to main.
    pol = make_policy("s3fifo", 10)
    for b in range(11):
        if len(pol) == 10:
            assert pol.victim() == 0
        pol.on_evictable(b if b < 10 else 0, f"k{b}" if b < 10 else "k0", 0)
    assert 0 in pol._m  # type: ignore[attr-defined]


def test_lru_k_retained_history_outlives_eviction() -> None:
    # A is evicted once, comes back with its retained first reference: 2 references, so the
    # once-seen blocks (C, D) go before it. Without retained history it is just another young block.
    seq = "ABCADEA"
    assert flags("lru_k", 2, seq, k=2) == [0, 0, 0, 0, 0, 0, 1]
    assert flags("lru_k", 2, seq, k=2, history=0) == [0, 0, 0, 0, 0, 0, 0]
    assert flags("lru", 2, seq) == [0, 0, 0, 0, 0, 0, 0]


def test_belady_evicts_furthest_next_use_and_deeper_on_ties() -> None:
    assert flags("belady", 2, "ABCAB") == [0, 0, 0, 1, 0]  # C evicts B (next use 4 > 3)
    assert flags("lru", 2, "ABCAB") == [0, 0, 0, 0, 0]
    pol = make_policy("belady", 4, oracle=lambda key: float("inf"))
    pol.on_evictable(7, "root", 0)
    pol.on_evictable(8, "child", 1)
    assert pol.victim() == 8
    with pytest.raises(ValueError):
        make_policy("belady", 4)


def test_depth_lru_learns_that_tails_are_not_reused() -> None:
    trace = rag(512, requests=1500, documents=300, doc_len=1024, system_len=512)
    unique = len({h for r in trace for h in r.hash_ids})
    cap = unique // 10
    lru = replay(trace, "lru", cap)
    ours = replay(trace, "depth_lru", cap)
    assert ours.block_hits > lru.block_hits
    pol = DepthLRUPolicy(30, min_trials=2)  # ghosts remember 30 keys
    for i in range(40):  # tail blocks never come back, interior ones always do
        pol.on_evictable(2 * i, f"tail{i}", 5, tail=0)
        pol.on_evictable(2 * i + 1, f"mid{i}", 4, tail=3)
        pol.on_hit(2 * i + 1)
        if len(pol) > 20:
            pol.victim()
    for i in range(150):  # push the tail ghosts out: each ages out as a "not reused" outcome
        b = 1000 + i
        pol.on_evictable(b, f"x{i}", 1, tail=3)
        pol.on_hit(b)
        while len(pol) > 20:
            pol.victim()
    p_tail = pol.reuse_probability(_class_of(0, False))
    assert p_tail is not None and p_tail < 0.1
    pol.on_evictable(5000, "new-tail", 9, tail=0)
    assert pol.victim() == 5000  # cold: evicted before every older warm block


def test_registry_rejects_unknown_policy() -> None:
    with pytest.raises(NanoKVError) as e:
        make_policy("mru", 4)
    assert e.value.field == "eviction_policy"


# ---- leaf_lru ------------------------------------------------------------------------------------
def _release(pol: LeafLRUPolicy, blocks: list[tuple[int, str]]) -> None:
    """One sequence freed tail first, as KVCacheManager.free does: (block, key) root first in ``blocks``."""
    for tail, (b, key) in enumerate(reversed(blocks)):
        pol.on_evictable(b, key, len(blocks) - 1 - tail, tail)


def test_leaf_lru_learns_that_last_blocks_are_dead_and_evicts_them_first() -> None:
    pol = LeafLRUPolicy(1000, horizon=64, min_trials=8)
    b = 0
    for turn in range(60):  # a chat: each turn re-sends the full blocks of the last one, never its last block
        blocks = [(b + i, f"c{i}") for i in range(3)] + [(b + 3, f"tail{turn}")]
        if turn:
            for i in range(3):
                pol.on_hit(b - 4 + i)  # (the real pool pins hit blocks; the policy only hears the hit)
        _release(pol, blocks)
        b += 4
    assert pol.dead[LAST] and not pol.dead[INTERIOR]
    p_last, p_int = pol.reuse_probability(LAST), pol.reuse_probability(INTERIOR)
    assert p_last == 0.0 and p_int is not None and p_int > 0.9
    _release(pol, [(9000, "fresh-root"), (9001, "fresh-tail")])
    cold = set(pol._cold)
    assert 9001 in cold and 9000 not in cold
    victims = [pol.victim() for _ in range(len(cold))]  # the dead leaves go first, oldest first ...
    assert set(victims) == cold and victims[-1] == 9001
    assert 9000 in pol._lru  # ... and the fresh root outlives every one of them


def test_leaf_lru_is_exactly_lru_when_last_blocks_come_back() -> None:
    # every prompt is sent twice (a retry): last blocks are reused as often as the rest, nothing is dead
    base = conversation(512, minutes=10, seed=3)
    trace = [r for r in base for _ in range(2)]
    keys = keys_of(trace)
    for cap in (40, 200):
        lru, ours = replay(trace, "lru", cap, keys=keys), replay(trace, "leaf_lru", cap, keys=keys)
        assert (ours.block_hits, ours.evictions) == (lru.block_hits, lru.evictions), cap


def test_leaf_lru_counts_a_reuse_whether_or_not_the_block_was_still_cached() -> None:
    # The evidence is "requested again within `horizon` releases": a hit if the block is cached, the
    # same hash computed again (a new block) if it was evicted. So evicting a class's blocks early
    # cannot make the class look worse - the flaw that made depth_lru spiral.
    for evicted in (False, True):
        pol = LeafLRUPolicy(100, horizon=10, min_trials=1)
        _release(pol, [(1, "root"), (2, "last")])
        if evicted:
            assert pol.victim() == 2  # not yet judged: plain LRU order (released tail first)
            assert pol.victim() == 1
            _release(pol, [(3, "root"), (4, "other")])  # "root" recomputed within the horizon
        else:
            pol.on_hit(1)
        assert pol._trials[BEFORE_LAST] == 1 and pol._reuses[BEFORE_LAST] == 1, evicted
        for i in range(12):  # "last" never comes back: it fails once the horizon has passed
            pol.on_evictable(100 + i, f"x{i}", 0, -1)  # (unknown position: interior)
        assert "last" not in pol._open and pol._reuses[LAST] == 0 and pol._trials[LAST] == 1 + evicted  # (+ "other")


def test_leaf_lru_hit_rescues_a_cold_block_and_forget_drops_it() -> None:
    pol = LeafLRUPolicy(100, horizon=4, min_trials=1)
    pol.dead[LAST] = True  # (as if learned)
    _release(pol, [(1, "a"), (2, "b")])
    assert list(pol._cold) == [2]
    pol.on_hit(2)
    assert not pol._cold and list(pol._lru) == [1, 2]
    pol.on_remove(1, forget=True)
    assert pol.victim() == 2 and len(pol) == 0
    assert pol.snapshot() == []


def test_every_policy_but_lru_and_leaf_lru_carries_a_caveat_and_only_a_retired_one_warns() -> None:
    assert set(ONLINE_POLICY_NAMES) - set(CAVEATS) == {"lru", "leaf_lru"}
    warned_policies.discard("depth_lru")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        make_policy("sieve", 8)  # a caveat, but a policy one may choose: silent
        make_policy("depth_lru", 8)
        make_policy("depth_lru", 8)  # once per process
        make_policy("leaf_lru", 8)
    assert [type(w.message) for w in got] == [PolicyCaveatWarning]
    assert "depth_lru" in str(got[0].message) and "leaf_lru" in str(got[0].message)
