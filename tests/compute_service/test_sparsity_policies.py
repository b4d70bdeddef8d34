"""Block-sparsity policies (pure Python): which blocks each policy keeps, the shared budget, and the
per-sequence state over a sequence's life; plus the live-bytes accounting and the manager's side of
hybrid's demotion store (external entries: the block goes back to the pool, every path that frees a
sequence hands the entry's code back exactly once)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanokv.cache_service.manager import KVCacheManager
from nanokv.cache_service.sparsity import POLICIES, SequenceSparsity, SparsityParams, keep_budget, plan
from nanokv.cache_service.sparsity.policies import on_interval_grid
from nanokv.compute_service.sparsity.accounting import KVBytes
from nanokv.errors import NanoKVError
from nanokv.kv.cache import bytes_per_block
from nanokv.kv.demote import code, slot_bytes
from nanokv.sparsity import budget_help, full_rate_blocks


def P(s: float, policy: str, **kw) -> SparsityParams:
    """Params for small test sequences: one sink, a 4-block recent window, no guaranteed ranked blocks
    (the defaults, 4 sinks + 32 recent + 8 ranked, are sized for 2k-token sequences)."""
    return SparsityParams(s, policy, **{"sink_blocks": 1, "recent_blocks": 4, "min_ranked": 0, **kw})


def _kept(p: SparsityParams, n: int, scores: list[float] | None = None) -> list[int]:
    pl = plan(p, n, list(range(n)), scores or [0.0] * n)
    return sorted(set(range(n)) - set(pl.drop))


def test_streaming_keeps_sinks_and_the_most_recent_blocks():
    assert _kept(P(0.5, "streaming"), 20) == [0] + list(range(11, 20))
    assert _kept(P(0.75, "streaming", sink_blocks=2), 20) == [0, 1, 16, 17, 18, 19]  # protected > budget 5
    assert _kept(P(0.75, "streaming", sink_blocks=2, recent_blocks=1), 20) == [0, 1, 17, 18, 19]


def test_interval_keeps_a_fixed_stride_pattern_plus_protected_blocks():
    assert [i for i in range(8) if on_interval_grid(i, 0.5)] == [1, 3, 5, 7]
    assert [i for i in range(8) if on_interval_grid(i, 0.75)] == [3, 7]
    assert sum(on_interval_grid(i, 0.25) for i in range(100)) == 75
    # 24 blocks at s = 0.5: budget 12 = sink 0 + recent 20..23 + 7 grid blocks (newest grid blocks first)
    assert _kept(P(0.5, "interval"), 24) == [0, 7, 9, 11, 13, 15, 17, 19, 20, 21, 22, 23]


def test_attention_keeps_the_highest_scores():
    scores = [0.0] * 20
    for i, v in ((3, 9.0), (7, 8.0), (12, 7.0)):
        scores[i] = v
    kept = _kept(P(0.75, "attention", recent_blocks=2), 20, scores)
    assert kept == [0, 3, 7, 18, 19]  # budget 5: sink + recent 2 + the two best scores


def test_hybrid_tiers_int8_int4_dropped_by_rank():
    n = 41  # sink 0 + recent 37..40; 36 candidates 1..36 ranked by score (higher index = higher score)
    scores = [float(i) for i in range(n)]
    pl = plan(P(0.5, "hybrid"), n, list(range(n)), scores)
    # budget ceil(20.5) = 21 -> 16 candidates kept (21..36), 20 dropped; of the kept, ceil(8) stay int8
    assert pl.drop == list(range(1, 21))
    assert pl.demote == list(range(21, 29))
    already = set(range(21, 25))
    assert plan(P(0.5, "hybrid"), n, list(range(n)), scores, already).demote == list(range(25, 29))
    assert plan(P(0.5, "attention"), n, list(range(n)), scores).demote == []


def test_min_ranked_blocks_survive_a_budget_below_the_protected_set():
    scores = [0.0] * 64
    scores[10] = scores[20] = 5.0
    p = SparsityParams(0.5, "attention", sink_blocks=4, recent_blocks=32, min_ranked=2)
    assert _kept(p, 64, scores) == [0, 1, 2, 3, 10, 20] + list(range(32, 64))  # 38 > budget 32
    assert len(_kept(p, 128, [0.0] * 128)) == 64  # long enough: exactly the budget


def test_nothing_happens_at_s0_or_while_protected_blocks_cover_the_budget():
    for pol in POLICIES:
        assert not plan(P(0.0, pol), 100, list(range(100)), [1.0] * 100)
        assert not plan(P(0.5, pol), 5, list(range(5)), [1.0] * 5)  # all 5 blocks protected
        assert len(plan(P(0.5, pol), 9, list(range(9)), [1.0] * 9).drop) == 4  # budget 5 = protected
    assert keep_budget(128, 0.5) == 64 and keep_budget(3, 0.5) == 2 and keep_budget(10, 0.7) == 3


def test_the_flags_help_names_where_the_budget_reaches_s():
    # the --compression-sparsity help (nanokv.sparsity.budget_help) says s is reached from full_rate_blocks on
    for s in (0.25, 0.5, 0.75):
        p = SparsityParams(s, "streaming")
        n0 = full_rate_blocks(p)
        for n in range(n0, n0 + 50):  # from there on exactly the budget: the fraction s, to rounding
            assert len(plan(p, n, list(range(n)), [0.0] * n).drop) == n - keep_budget(n, s)
        # shorter (the budget below the 44 always-kept blocks, not only by rounding): fewer go
        short = math.floor((p.sink_blocks + p.recent_blocks + p.min_ranked - 1) / (1 - s))
        assert len(plan(p, short, list(range(short)), [0.0] * short).drop) < short - keep_budget(short, s)
    assert full_rate_blocks(SparsityParams(0.5)) == 88
    assert "from 88 blocks = 1,408 tokens at block size 16" in budget_help(16)


@settings(max_examples=60, deadline=None)
@given(s=st.sampled_from([0.25, 0.5, 0.75, 0.9]), pol=st.sampled_from(POLICIES), sinks=st.integers(0, 2),
       recent=st.integers(0, 6), ranked=st.integers(0, 3), steps=st.lists(st.integers(1, 70), min_size=1, max_size=12),
       seed=st.integers(0, 99))
def test_budget_monotone_and_protected_over_a_sequence_life(s, pol, sinks, recent, ranked, steps, seed):
    """Grow a sequence chunk by chunk: after every step the live full blocks equal the budget (or the
    protected set), protected blocks are never dropped, dropped ones never return."""
    rng = random.Random(seed)
    p = SparsityParams(s, pol, sinks, recent, ranked)
    seq = SequenceSparsity(p, 16)
    computed = 0
    for n_new in steps:
        computed += n_new
        n_full = computed // 16
        seq.observe([rng.random() for _ in range(-(-computed // 16))])
        before = set(seq.dropped)
        pl = seq.plan(computed)
        assert not set(pl.drop) & before and not set(pl.demote) & set(pl.drop)
        seq.commit(pl.drop, pl.demote)
        live = seq.live_full(computed)
        prot = set(range(min(sinks, n_full))) | set(range(max(0, n_full - recent), n_full))
        assert prot <= set(live)
        assert len(live) == min(n_full, max(len(prot) + ranked, math.ceil((1 - s) * n_full - 1e-9)))
        assert not seq.demoted & seq.dropped and (pol == "hybrid" or not seq.demoted)


def test_scores_accumulate_by_max_or_by_sum():
    a, b = SequenceSparsity(P(0.5, "attention"), 16), \
        SequenceSparsity(P(0.5, "attention", score_mode="sum"), 16)
    for st_ in (a, b):
        st_.observe([1.0, 3.0])
        st_.observe([2.0, 1.0, 5.0])
    assert a.scores == [2.0, 3.0, 5.0] and b.scores == [3.0, 4.0, 5.0]


def test_live_bytes_count_each_block_at_its_format():
    kb = KVBytes([8, 8, 16, 4], num_kv_heads=3, block_size=16, head_dim=64)
    per = {b: bytes_per_block(b, 3, 16, 64, torch.bfloat16) for b in (4, 8, 16)}
    assert kb.block_bytes == 2 * per[8] + per[16] + per[4]
    table = [5, -1, 7, 9, 11]  # logical 1 dropped; 4.5 blocks computed -> blocks 0..4 live but 1
    assert kb.live(table, 70) == 4 * kb.block_bytes
    assert kb.live(table, 33) == 2 * kb.block_bytes  # only blocks covering computed tokens
    # hybrid (every layer int8): a demoted entry holds a demotion-store slot in each layer instead
    kb8 = KVBytes([8] * 3, num_kv_heads=3, block_size=16, head_dim=64)
    assert kb8.demoted_block_bytes == 3 * slot_bytes(3, 16, 64) == 3 * 2 * 3 * 16 * (32 + 4)
    assert kb8.live([5, -1, code(0), 9, code(3)], 70) == 2 * kb8.block_bytes + 2 * kb8.demoted_block_bytes


class _Slots:
    """The external owner's side: which codes are out, and every release."""

    def __init__(self) -> None:
        self.out: set[int] = set()
        self.released: list[int] = []

    def release(self, c: int) -> None:
        assert c in self.out, f"{c} released but not out"
        self.out.remove(c)
        self.released.append(c)


def test_replace_with_external_releases_the_block_and_every_path_returns_the_code():
    cm = KVCacheManager(16, 4)
    toks = list(range(100, 117))  # 4 full blocks + 1
    cm.allocate("a", len(toks))
    cm.cache_blocks("a", toks, 8)  # blocks 0, 1 published
    owner = _Slots()
    with pytest.raises(NanoKVError, match="set_external_release"):
        cm.replace_with_external("a", 2, code(0))
    cm.set_external_release(owner.release)
    tab = cm.block_table("a")
    for bad in ({"logical_index": 9}, {"logical_index": True}, {"code": -1}, {"code": 3}, {"code": 2.5}):
        kw = {"logical_index": 2, "code": code(0), **bad}
        with pytest.raises(NanoKVError):
            cm.replace_with_external("a", kw["logical_index"], kw["code"])
    free0 = cm.num_free_blocks()
    b1, b2 = tab[1], tab[2]
    for i, j in ((1, 0), (2, 1)):
        owner.out.add(code(j))
        assert cm.replace_with_external("a", i, code(j)) == (b1, b2)[i - 1]
    assert tab[1:3] == [code(0), code(1)] and cm.num_free_blocks() == free0 + 2  # really back in the pool
    with pytest.raises(NanoKVError):  # already external
        cm.replace_with_external("a", 1, code(5))
    # block 1 was published before: its int8 content is intact and exact, so it stays a cached prefix
    # (never the int4 copy); nothing from block 1 on is published any more
    cm.cache_blocks("a", toks, 17)
    assert cm.match_prefix(toks).block_ids == [tab[0], b1] and cm.num_cached_blocks() == 2
    cm.drop_blocks("a", [2])  # dropping an external entry returns its code, the entry is a hole
    assert tab[2] == -1 and owner.released == [code(1)]
    cm.free("a")  # finish / abort / preemption all free: the remaining code comes back
    assert owner.out == set() and owner.released == [code(1), code(0)]
    assert cm.num_used_blocks() == 0 and cm.num_free_blocks() == 16


def test_held_alone_skips_shared_blocks_holes_and_external_entries():
    cm = KVCacheManager(16, 4)
    cm.set_external_release(lambda c: None)
    toks = list(range(100, 113))  # 3 full blocks + 1
    cm.allocate("a", len(toks))
    cm.cache_blocks("a", toks, len(toks))
    cm.allocate("b", len(toks), cm.match_prefix(toks))  # b shares a's three full blocks
    assert cm.held_alone("a", [0, 1, 2, 3]) == [3]
    cm.free("b")
    cm.drop_blocks("a", [0])
    cm.replace_with_external("a", 1, code(0))
    assert cm.held_alone("a", [0, 1, 2, 3, 7]) == [2, 3]


def test_params_are_validated():
    for kw in ({"sparsity": 1.0}, {"sparsity": 0.5, "policy": "lru"}, {"sparsity": 0.5, "score_mode": "mean"},
               {"sparsity": 0.5, "recent_blocks": -1}):
        with pytest.raises(ValueError):
            SparsityParams(**kw)
