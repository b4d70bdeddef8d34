"""The memory hierarchy below the device pool (cache_service/tiers, docs/hierarchy.md).

Real KVCacheManager, real salted chained hashes, real eviction policies; small traces so it is fast.
"""

from __future__ import annotations

import random

import pytest
from nanokv_tools.sim.replay import keys_of, replay
from nanokv_tools.sim.tiered_replay import TierSpec, budget_bytes, check_invariants, replay_tiered
from nanokv_tools.sim.traces import TraceRequest, multi_turn

from nanokv.cache_service.hashing import hash_full_blocks
from nanokv.cache_service.manager import KVCacheManager
from nanokv.cache_service.policies import ONLINE_POLICY_NAMES
from nanokv.cache_service.tiers.formats import KVShape, layer_block_bytes, smollm2_135m, tier_format
from nanokv.cache_service.tiers.hierarchy import TieredCache
from nanokv.cache_service.tiers.lower_tier import LowerTier
from nanokv.errors import NanoKVError

BS = 4
SHAPE = smollm2_135m(BS)
BF16 = tier_format("bf16", SHAPE)


def _tiers(*caps: int, keep: tuple[bool, ...] = (), policy: str = "lru") -> list[LowerTier]:
    return [LowerTier(f"L{i + 2}", c, BF16, policy, keep_on_load=(keep[i] if i < len(keep) else False))
            for i, c in enumerate(caps)]


def _request(cm: KVCacheManager, tc: TieredCache, seq: object, tokens: list[int], salt: str | None = None) -> list[int]:
    """The engine's order of calls for one prompt; returns [L1 hits, hits per lower tier...]."""
    m = cm.match_prefix(tokens, salt)
    lm = tc.match_lower(m)
    tc.begin_load(lm)
    assert cm.allocate(seq, len(tokens), m, lm.resident()) is not None
    cm.cache_blocks(seq, tokens, len(tokens), salt)
    tc.finish_load(lm)
    cm.free(seq)
    return lm.per_level(len(tc.names))


def _prompt(tag: int, blocks: int) -> list[int]:
    """``blocks`` full blocks of tokens unique to ``tag``, plus one token (left to compute): it takes
    blocks + 1 L1 blocks while it runs and leaves ``blocks`` cached."""
    return [tag * 1000 + i for i in range(blocks * BS)] + [7]


def test_byte_counts_match_the_device_layout() -> None:
    torch = pytest.importorskip("torch")
    from nanokv.kv.cache import bytes_per_block

    for bits in (16, 8, 4):
        for heads, bs, dim in ((3, 16, 64), (8, 32, 128), (1, 512, 64)):
            assert layer_block_bytes(bits, heads, bs, dim, 2) == bytes_per_block(bits, heads, bs, dim, torch.bfloat16)
    shape = KVShape(30, 3, 64, 512)
    bf16, int8, int4 = (tier_format(f, shape).bytes_per_block for f in ("bf16", "int8", "int4"))
    assert bf16 == 30 * 2 * 3 * 512 * 64 * 2
    assert 1.9 < bf16 / int8 < 2.0 and 3.6 < bf16 / int4 < 4.0  # scales cost a little of the 2x / 4x


def test_hook_is_unset_without_lower_tiers() -> None:
    cm = KVCacheManager(4, BS, eviction_policy="lru")
    assert cm.pool.on_evict is None
    TieredCache(cm, [])
    assert cm.pool.on_evict is None
    TieredCache(cm, _tiers(2))
    assert cm.pool.on_evict is not None


def test_a_chain_broken_in_l1_continues_in_l2() -> None:
    cm = KVCacheManager(5, BS, eviction_policy="lru")
    tc = TieredCache(cm, _tiers(8))
    a, b = _prompt(1, 3), _prompt(2, 4)
    assert _request(cm, tc, "a", a) == [0, 0]
    assert _request(cm, tc, "b", b) == [0, 0]  # 5 fresh blocks: a's 3 cached blocks go to L2
    assert tc.stats.moved == {"L1->L2": 3}
    assert _request(cm, tc, "a2", a) == [0, 3]  # all of a from L2, into fresh L1 blocks
    assert tc.stats.hit_blocks == {"L1": 0, "L2": 3} and tc.stats.moved["L2->L1"] == 3
    # L2 does not keep a loaded block's copy (keep_on_load=False): L1 is the only holder now
    ha = hash_full_blocks(a, BS)
    assert all(tc.owner(h) == "L1" and h not in tc.tiers[0] for h in ha)
    # a2 evicted b's 3 deepest blocks (LRU: a request's root is released last): L1 then L2
    assert _request(cm, tc, "b2", b) == [1, 3]
    check_invariants(tc)


@pytest.mark.parametrize("policy", ["clock", "lru", "lru_k", "arc"])
def test_l1_blocks_past_a_lost_head_are_reused_not_recomputed(policy: str) -> None:
    """Two prompts that do not fit L1 together, taking turns. A policy that is not leaf-first (clock:
    a block keeps its ring position while pinned) evicts a chain's head and keeps later blocks; the
    head comes back from L2 and the chain goes on through the blocks L1 kept, in place, so every
    turn after the first is a full hit, whatever the policy."""
    cm = KVCacheManager(12, BS, eviction_policy=policy)
    tc = TieredCache(cm, _tiers(32))
    a, b = _prompt(1, 8), _prompt(2, 8)
    seen = []
    for i in range(8):
        p = a if i % 2 == 0 else b
        m = cm.match_prefix(p)
        lm = tc.match_lower(m)
        tc.begin_load(lm)
        table = cm.allocate(i, len(p), m, lm.resident())
        assert table is not None
        assert all(table[pos] == blk for pos, blk in lm.resident().items())
        cm.cache_blocks(i, p, len(p))
        tc.finish_load(lm)
        cm.free(i)
        seen.append(sum(lm.per_level(2)))
        check_invariants(tc)
    assert seen[:2] == [0, 0] and seen[2:] == [8] * 6, seen
    assert cm.pool.num_used == 0 and tc.tiers[0].num_evictable == len(tc.tiers[0])


def test_chain_mixes_l1_l2_l3_and_counts_add_up() -> None:
    cm = KVCacheManager(4, BS, eviction_policy="lru")
    tc = TieredCache(cm, _tiers(3, 6, keep=(False, True)))
    prompts = [_prompt(t, 3) for t in range(4)]
    for i, p in enumerate(prompts):
        _request(cm, tc, i, p)
    # L1 holds prompt 3, L2 prompt 2, L3 prompts 0 and 1 (L2's victims)
    assert [tc.owner(h) for h in hash_full_blocks(prompts[0], BS)] == ["L3"] * 3
    assert [tc.owner(h) for h in hash_full_blocks(prompts[2], BS)] == ["L2"] * 3
    assert tc.stats.moved == {"L1->L2": 9, "L2->L3": 6}
    assert _request(cm, tc, "x", prompts[0]) == [0, 0, 3]
    # L3 keeps a replica (keep_on_load): the block is owned by L1 and still on disk
    h0 = hash_full_blocks(prompts[0], BS)[0]
    assert tc.owner(h0) == "L1" and h0 in tc.tiers[1]
    # evicting it again from L1 writes it to L2 (L2 lacks it) ...
    _request(cm, tc, "y", _prompt(8, 3))
    assert tc.owner(h0) == "L2" and h0 in tc.tiers[1]
    # ... and L2's eviction of it is a hand-over to L3, no copy
    moved = tc.stats.moved["L2->L3"]
    _request(cm, tc, "z", _prompt(9, 3))
    assert tc.owner(h0) == "L3"
    assert tc.stats.handed_down["L2->L3"] == 3 and tc.stats.moved["L2->L3"] == moved
    check_invariants(tc)


def test_blocks_being_loaded_survive_their_own_allocation() -> None:
    """L2 holds 2 blocks: loading a's 2 blocks from a full L2 evicts b's 2 blocks from L1, which cannot
    push a's pinned copies out: they are dropped (L2 has no unpinned slot, and there is no L3)."""
    cm = KVCacheManager(3, BS, eviction_policy="lru")
    tc = TieredCache(cm, _tiers(2))
    a, b = _prompt(1, 2), _prompt(2, 2)
    _request(cm, tc, "a", a)
    _request(cm, tc, "b", b)  # a's 2 blocks -> L2, now full
    assert _request(cm, tc, "a2", a) == [0, 2]
    assert tc.stats.dropped["L1"] == 2 and tc.stats.moved == {"L1->L2": 2, "L2->L1": 2}
    check_invariants(tc)


def test_tenants_never_share_a_block_in_any_tier() -> None:
    cm = KVCacheManager(4, BS, eviction_policy="lru")
    tc = TieredCache(cm, _tiers(3, 12))  # L3 keeps everything: a miss can only come from the salt
    shared = _prompt(5, 3)
    for i in range(4):  # tenant a's prompt, then others push it down to L2 and L3
        _request(cm, tc, f"a{i}", shared if i == 0 else _prompt(50 + i, 3), salt="tenant-a")
    assert _request(cm, tc, "b", shared, salt="tenant-b") == [0, 0, 0]
    assert _request(cm, tc, "c", shared, salt=None) == [0, 0, 0]
    assert sum(_request(cm, tc, "a-again", shared, salt="tenant-a")) == 3  # same tenant: hits
    check_invariants(tc)


def _small_trace(seed: int, n: int = 150) -> list[TraceRequest]:
    """Random prefix-chained requests: a few roots, each request extends a random earlier chain."""
    rng = random.Random(seed)
    chains: list[list[int]] = []
    out = []
    nxt = 0
    for i in range(n):
        if chains and rng.random() < 0.7:
            base = rng.choice(chains)[: rng.randint(1, len(rng.choice(chains)))]
        else:
            base = []
        ids = list(base)
        for _ in range(rng.randint(1, 5)):
            nxt += 1
            ids.append(nxt)
        chains.append(ids)
        out.append(TraceRequest(float(i), len(ids) * 8 - rng.randint(0, 7), 1, ids))
    return out


@pytest.mark.parametrize("policy", ["lru", "leaf_lru", "s3fifo", "belady"])
def test_tiered_replay_without_lower_tiers_is_the_l1_replay(policy: str) -> None:
    reqs = multi_turn(512, conversations=40, turns=4)
    keys = keys_of(reqs)
    for cap in (8, 40):
        one = replay(reqs, policy, cap, keys=keys)
        tiered = replay_tiered(reqs, policy, cap, [], shape=smollm2_135m(512), keys=keys)
        assert (tiered.hit_blocks["L1"], tiered.hit_tokens["L1"]) == (one.block_hits, one.token_hits)
        assert tiered.block_total == one.block_total and tiered.counters["evictions"]["L1"] == one.evictions


def test_an_l2_as_big_as_the_rest_matches_a_bigger_l1_under_lru() -> None:
    """Exclusive LRU tiers (L2 drops a loaded copy) hold L1 + L2 distinct blocks: close to one LRU cache
    of that size, and never below L1 alone."""
    reqs = multi_turn(512, conversations=60, turns=5)
    keys = keys_of(reqs)
    unique = len({h for r in reqs for h in r.hash_ids})
    c1 = max(4, unique // 20)
    alone = replay(reqs, "lru", c1, keys=keys).block_hit_ratio
    big = replay(reqs, "lru", 5 * c1, keys=keys).block_hit_ratio
    t = replay_tiered(reqs, "lru", c1, [TierSpec("L2", "4x")], shape=smollm2_135m(512), keys=keys)
    assert t.block_hit_ratio > alone
    assert abs(t.block_hit_ratio - big) < 0.02
    assert t.hit_blocks["L2"] > 0 and t.counters["moved"]["L2->L1"] == t.hit_blocks["L2"]


@pytest.mark.parametrize("seed", range(6))
def test_randomized_invariants(seed: int) -> None:
    rng = random.Random(seed)
    reqs = _small_trace(seed)
    specs = [TierSpec("L2", str(rng.randint(1, 12)), rng.choice(ONLINE_POLICY_NAMES), rng.choice(["bf16", "int8"]),
                      rng.random() < 0.5)]
    if rng.random() < 0.7:
        specs.append(TierSpec("L3", str(rng.randint(1, 20)), rng.choice(ONLINE_POLICY_NAMES), "int4",
                              rng.random() < 0.5))
    l1 = rng.randint(5, 12)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = replay_tiered(reqs, rng.choice(ONLINE_POLICY_NAMES), l1, specs, 8, shape=KVShape(2, 1, 8, 8),
                          check_every=1)
    alone = replay(reqs, "lru", l1, 8)
    assert sum(r.hit_blocks.values()) <= r.block_total
    assert r.counters["evictions"]["L1"] > 0  # the trace is bigger than L1
    # every L1 victim went down (written or handed over) or is counted dropped
    ev = r.counters["evictions"]["L1"]
    down = sum(v for k, v in (*r.counters["moved"].items(), *r.counters["handed_down"].items())
               if k.startswith("L1->"))
    assert ev == down + r.counters["dropped"]["L1"] + r.counters["replica_dropped"]["L1"]
    assert alone.block_hits <= r.block_total


def test_bad_sizes_and_formats_name_the_field() -> None:
    with pytest.raises(NanoKVError, match="L2 capacity"):
        LowerTier("L2", 0, BF16)
    with pytest.raises(NanoKVError, match="format"):
        tier_format("fp8", SHAPE)
    with pytest.raises(NanoKVError, match="l2 budget"):
        budget_bytes("lots", l1_blocks=4, unique_blocks=100, l1_format=BF16, field_name="l2 budget")
    def size(text: str) -> int:
        return budget_bytes(text, l1_blocks=4, unique_blocks=100, l1_format=BF16, field_name="l2")

    assert size("4x") == 16 * BF16.bytes_per_block and size("10%") == 10 * BF16.bytes_per_block
    assert size("1GiB") == 1 << 30 and size("3") == 3 * BF16.bytes_per_block
    cm = KVCacheManager(2, BS)
    with pytest.raises(NanoKVError, match="tiers"):
        TieredCache(cm, [LowerTier("L1", 2, BF16)])


def test_simulate_reports_the_hierarchy(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from nanokv_tools.sim.simulate import main

    out = tmp_path / "sim.json"
    args = ["--trace", "synthetic:multi_turn", "--policies", "lru", "--capacity", "5%", "--no-progress",
            "--jobs", "1", "--l2", "4x", "--l2-format", "int8", "--tier-l1-policies", "lru"]
    assert main([*args, "--json", str(out)]) == 0
    assert "L2 4x int8 lru" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    (h,) = doc["hierarchy"]
    lru = doc["results"][0]
    assert h["hit_blocks"]["L1"] == lru["block_hits"] and h["hit_blocks"]["L2"] > 0
    assert h["tiers"][0]["format"] == "int8" and h["tiers"][0]["capacity"] > 7 * h["l1_capacity"]  # ~2x of 4x
    assert main([*args, "--l3", "none"]) == 2
    assert "l3 budget" in capsys.readouterr().err
