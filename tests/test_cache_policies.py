"""Hand-built micro traces with exactly known hits, one behaviour per policy.

Single-block requests go through the real manager (``replay``), so a hit is plain cache membership
and every policy sees exactly the calls the engine makes.
"""

from __future__ import annotations

import pytest

from nanokv.cache_service import KVCacheManager, make_policy
from nanokv.cache_service.policies.depth_lru import DepthLRUPolicy, _class_of
from nanokv.errors import NanoKVError
from nanokv.sim.replay import replay
from nanokv.sim.traces import TraceRequest, rag


def _trace(seq: str) -> list[TraceRequest]:
    return [TraceRequest(float(i), 512, 1, [ord(c)]) for i, c in enumerate(seq)]


def flags(policy: str, capacity: int, seq: str, **kw: object) -> list[int]:
    """Hit flag per request of ``seq`` (one letter = one single-block request)."""
    from nanokv.sim.replay import NextUseOracle, keys_of

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
