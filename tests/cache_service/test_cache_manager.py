"""KVCacheManager API semantics (the contract the scheduler is written against) and hashing."""

from __future__ import annotations

import pytest

from nanokv.cache_service import KVCacheManager
from nanokv.cache_service.hashing import block_hash, hash_full_blocks, root_hash
from nanokv.errors import NanoKVError

BS = 4


def run_prompt(cm: KVCacheManager, sid: object, tokens: list[int], salt: str | None = None) -> list[int]:
    m = cm.match_prefix(tokens, salt)
    table = cm.allocate(sid, len(tokens), m)
    assert table is not None
    cm.cache_blocks(sid, tokens, len(tokens), salt)
    return table


def test_hash_chain_salt_and_algorithms() -> None:
    toks = list(range(12))
    a = hash_full_blocks(toks, BS)
    assert len(a) == 3 and len(set(a)) == 3
    assert a[1] == block_hash(a[0], toks[4:8])  # chained on the parent hash
    assert hash_full_blocks(toks[:8] + [99] * 4, BS)[:2] == a[:2]  # same prefix, same hashes
    assert hash_full_blocks([0] + toks[1:], BS)[0] == a[0]
    assert hash_full_blocks([5] + toks[1:], BS)[2] != a[2]  # a change anywhere changes all later blocks
    assert set(hash_full_blocks(toks, BS, "t1")).isdisjoint(a)  # salts never share
    assert root_hash("") != root_hash(None)
    assert hash_full_blocks(toks, BS, algo="blake2b") != a
    with pytest.raises(NanoKVError):
        hash_full_blocks(toks, BS, algo="md5")
    with pytest.raises(NanoKVError):
        root_hash(3)  # type: ignore[arg-type]


def test_prefix_hit_pins_shared_blocks_and_caps_one_token() -> None:
    cm = KVCacheManager(8, BS, eviction_policy="lru")
    t = run_prompt(cm, "a", list(range(10)))
    assert t == [0, 1, 2] and cm.num_used_blocks() == 3
    m = cm.match_prefix(list(range(8)))  # exactly two full cached blocks: the last one is dropped
    assert m.block_ids == [0] and m.num_tokens == 4 and len(m.block_hashes) == 2
    m = cm.match_prefix(list(range(9)) + [77])
    assert m.block_ids == [0, 1] and m.num_query_tokens == 10
    t2 = cm.allocate("b", 10, m)
    assert t2 is not None and t2[:2] == [0, 1] and cm.pool.ref[0] == 2
    assert cm.stats.prefix_hits_tokens == 8 and cm.stats.prefix_queries_tokens == 20
    cm.free("a")
    cm.free("b")
    assert cm.num_used_blocks() == 0 and cm.num_free_blocks() == 8 and cm.num_cached_blocks() == 2


def test_allocate_failure_changes_nothing_and_stale_match_is_revalidated() -> None:
    cm = KVCacheManager(4, BS, eviction_policy="clock")
    run_prompt(cm, "a", list(range(9)))
    cm.free("a")
    m = cm.match_prefix(list(range(9)))
    assert m.block_ids == [0, 1]
    before = (cm.num_free_blocks(), dict(cm.pool.index), cm.stats.prefix_queries)
    assert cm.allocate("big", 4 * BS + 1, m) is None  # needs 5 blocks, pool has 4
    assert (cm.num_free_blocks(), dict(cm.pool.index), cm.stats.prefix_queries) == before
    run_prompt(cm, "x", [50 + i for i in range(16)])  # evicts everything cached
    cm.free("x")
    t = cm.allocate("late", 9, m)  # the old match is stale: no block is reused blindly
    assert t is not None and cm.stats.prefix_hits_tokens == 0
    assert cm.stats.evictions == 2 + 3 and cm.stats.evictions_by_policy["clock"] == 5


def test_grow_can_grow_and_no_state_change_when_short() -> None:
    cm = KVCacheManager(3, BS)
    cm.allocate("a", 4)
    assert cm.grow("a", 8) and cm.block_table("a") == [0, 1]
    assert cm.can_grow("a", 12) and not cm.can_grow("a", 13)
    assert not cm.grow("a", 13) and len(cm.block_table("a")) == 2
    assert cm.grow("a", 5)  # already covered


def test_cache_blocks_is_incremental_idempotent_and_keeps_existing_duplicates() -> None:
    cm = KVCacheManager(8, BS, eviction_policy="lru")
    toks = list(range(12))
    cm.allocate("a", 12)
    cm.cache_blocks("a", toks, 5)
    assert cm.num_cached_blocks() == 1
    cm.cache_blocks("a", toks, 5)
    cm.cache_blocks("a", toks, 12)
    assert cm.num_cached_blocks() == 3 and cm.stats.blocks_cached == 3
    cm.allocate("b", 12)  # same tokens computed again without a prefix hit
    cm.cache_blocks("b", toks, 12)
    assert cm.num_cached_blocks() == 3  # the first mapping wins; b's blocks stay private
    cm.free("b")
    assert cm.num_free_blocks() == 5 and len(cm.pool.free) == 5  # b's private blocks go to the free list


def test_free_releases_tail_first() -> None:
    cm = KVCacheManager(6, BS, eviction_policy="lru")
    run_prompt(cm, "a", list(range(12)))
    cm.free("a")
    assert list(cm.pool.policy._order) == [2, 1, 0]  # type: ignore[attr-defined]  # root most recent
    run_prompt(cm, "b", [100 + i for i in range(16)])  # 4 blocks: 3 free ones + 1 eviction
    cm.free("b")
    assert cm.match_prefix(list(range(12))).block_ids == [0, 1]  # the tail went first


def test_drop_blocks_makes_holes_and_stops_caching_after_them() -> None:
    cm = KVCacheManager(8, BS)
    toks = list(range(16))
    cm.allocate("a", 16)
    cm.drop_blocks("a", [1])
    assert cm.block_table("a")[1] == -1 and cm.num_used_blocks() == 3
    cm.cache_blocks("a", toks, 16)
    assert cm.num_cached_blocks() == 1  # only block 0, before the hole
    cm.drop_blocks("a", [1])  # dropping a hole again is a no-op
    with pytest.raises(NanoKVError):
        cm.drop_blocks("a", [9])
    cm.free("a")
    assert cm.num_used_blocks() == 0 and cm.num_free_blocks() == 8


def test_recompute_and_preemption_counters() -> None:
    cm = KVCacheManager(3, BS, eviction_policy="lru")
    toks = list(range(9))
    run_prompt(cm, "a", toks)
    cm.free("a")
    run_prompt(cm, "x", [70] * 9)
    cm.free("x")  # evicted a's blocks
    m = cm.match_prefix(toks)
    assert m.block_ids == []
    cm.allocate("a2", 9, m)
    assert cm.stats.recomputed_tokens == 2 * BS
    cm.record_recompute(5)
    cm.record_preemption()
    assert cm.stats.recomputed_tokens == 2 * BS + 5 and cm.stats.preemptions == 1


@pytest.mark.parametrize("new", ["lru", "lru_k", "clock", "arc", "s3fifo", "sieve", "depth_lru"])
def test_set_policy_keeps_cached_blocks(new: str) -> None:
    cm = KVCacheManager(8, BS, eviction_policy="clock")
    run_prompt(cm, "a", list(range(9)))
    cm.free("a")
    run_prompt(cm, "b", list(range(100, 105)))  # still running
    cm.set_policy(new)
    assert cm.match_prefix(list(range(9))).block_ids == [0, 1]
    assert len(cm.pool.policy) == cm.pool.num_evictable == 2
    cm.free("b")
    assert len(cm.pool.policy) == 3
    run_prompt(cm, "c", [200 + i for i in range(32)])  # forces every cached block out
    assert cm.num_cached_blocks() == 8 and cm.stats.evictions == 3


def test_reset_prefix_cache_only_when_idle_and_salts_isolate() -> None:
    cm = KVCacheManager(8, BS)
    run_prompt(cm, "a", list(range(9)), salt="t1")
    assert cm.match_prefix(list(range(9)), "t2").block_ids == []
    assert cm.match_prefix(list(range(9))).block_ids == []
    assert not cm.reset_prefix_cache()
    cm.free("a")
    assert cm.match_prefix(list(range(9)), "t1").block_ids == [0, 1]
    assert cm.reset_prefix_cache()
    assert cm.num_cached_blocks() == 0 and cm.num_free_blocks() == 8
    assert cm.match_prefix(list(range(9)), "t1").block_ids == []


def test_disabled_prefix_caching_and_bad_input() -> None:
    cm = KVCacheManager(4, BS, enable_prefix_caching=False)
    run_prompt(cm, "a", list(range(9)))
    cm.free("a")
    assert cm.num_cached_blocks() == 0 and cm.match_prefix(list(range(9))).block_ids == []
    with pytest.raises(NanoKVError):
        KVCacheManager(0, BS)
    with pytest.raises(NanoKVError):
        KVCacheManager(4, BS, eviction_policy="nope")
    with pytest.raises(NanoKVError):
        KVCacheManager(4, BS, lru_k=5)
    with pytest.raises(NanoKVError):
        cm.allocate("b", -1)
    cm.allocate("b", 1)
    with pytest.raises(NanoKVError):
        cm.allocate("b", 1)
    with pytest.raises(NanoKVError):
        cm.block_table("zzz")
    with pytest.raises(NanoKVError):
        KVCacheManager(4, BS).match_prefix(["x"] * 8, None)  # type: ignore[list-item]
    cm.free("never-allocated")  # freeing twice / unknown ids is harmless
