"""Hypothesis state machine: random operation sequences against the manager, for every policy.

A shadow model keeps the token contents (and salt) of every block, the live sequences and their
tables; after every step the invariants of the block pool are checked against it.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from nanokv.cache_service import KVCacheManager
from nanokv.cache_service.hashing import hash_full_blocks
from nanokv.cache_service.policies import POLICY_NAMES

# >= 1000 random sequences per policy; NANOKV_HYPOTHESIS_SCALE lowers it for a quick local run.
EXAMPLES = int(1000 * float(os.environ.get("NANOKV_HYPOTHESIS_SCALE", "1")))
STEPS = 12  # sized so the whole cache suite stays under 3 minutes on 2 cores
TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=14)  # tiny alphabet: lots of sharing
SALTS = st.sampled_from([None, "tenant-a", "tenant-b"])


class CacheMachine(RuleBasedStateMachine):
    policy = "lru"
    seqs = Bundle("seqs")

    @initialize(num_blocks=st.integers(3, 10), block_size=st.sampled_from([1, 2, 3]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        kw = {"oracle": lambda key: float(hash(key) % 13)} if self.policy == "belady" else {}
        self.cm = KVCacheManager(num_blocks, block_size, eviction_policy=self.policy, policy_kwargs=kw)
        self.bs = block_size
        self.content: dict[int, tuple[str | None, tuple[int, ...]]] = {}  # hashed block -> prefix
        self.live: dict[int, tuple[list[int], str | None]] = {}  # seq -> (tokens, salt)
        self.next_id = 0

    # ---- operations ------------------------------------------------------------------------------
    @rule(target=seqs, tokens=TOKENS, salt=SALTS)
    def start(self, tokens: list[int], salt: str | None) -> int:
        cm = self.cm
        m = cm.match_prefix(tokens, salt)
        # A hit is exactly the matching prefix: block i holds tokens[:(i+1)*bs] under this salt ...
        for i, b in enumerate(m.block_ids):
            assert self.content[b] == (salt, tuple(tokens[: (i + 1) * self.bs]))
        # ... it leaves one token to compute, and it is maximal.
        assert m.num_tokens == len(m.block_ids) * self.bs and (not tokens or m.num_tokens < len(tokens))
        k = len(m.block_ids)
        if (k + 1) * self.bs < len(tokens):
            cached = {self.content[b] for b in self.cm.pool.index.values()}
            assert (salt, tuple(tokens[: (k + 1) * self.bs])) not in cached
        before = (cm.num_free_blocks(), cm.num_used_blocks(), dict(cm.pool.index))
        sid = self.next_id
        self.next_id += 1
        table = cm.allocate(sid, len(tokens), m)
        if table is None:
            assert (cm.num_free_blocks(), cm.num_used_blocks(), dict(cm.pool.index)) == before
            return -1
        assert table[:k] == m.block_ids and len(table) == -(-len(tokens) // self.bs)
        self.live[sid] = (list(tokens), salt)
        return sid

    def _cache(self, sid: int, n: int) -> None:
        tokens, salt = self.live[sid]
        self.cm.cache_blocks(sid, tokens, n, salt)
        for i, b in enumerate(self.cm.block_table(sid)):
            if b >= 0 and self.cm.pool.hash[b] is not None and i < n // self.bs:
                self.content[b] = (salt, tuple(tokens[: (i + 1) * self.bs]))

    @rule(sid=seqs, frac=st.floats(0, 1))
    def compute(self, sid: int, frac: float) -> None:
        if sid in self.live:
            self._cache(sid, int(len(self.live[sid][0]) * frac))

    @rule(sid=seqs, more=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def grow(self, sid: int, more: list[int]) -> None:
        if sid not in self.live:
            return
        tokens, _ = self.live[sid]
        if self.cm.grow(sid, len(tokens) + len(more)):
            tokens.extend(more)

    @rule(sid=consumes(seqs))
    def finish(self, sid: int) -> None:
        if sid in self.live:
            self._cache(sid, len(self.live[sid][0]))
            self.cm.free(sid)
            del self.live[sid]

    @rule(sid=seqs, data=st.data())
    def drop(self, sid: int, data: st.DataObject) -> None:
        if sid in self.live and self.cm.block_table(sid):
            n = len(self.cm.block_table(sid))
            self.cm.drop_blocks(sid, [data.draw(st.integers(0, n - 1))])

    @rule(name=st.sampled_from([p for p in POLICY_NAMES if p != "belady"]))
    def switch(self, name: str) -> None:
        if self.policy != "belady":
            self.cm.set_policy(name)

    @rule()
    def reset(self) -> None:
        ok = self.cm.reset_prefix_cache()
        assert ok == (self.cm.num_used_blocks() == 0)

    # ---- invariants --------------------------------------------------------------------------------
    @invariant()
    def pool_consistent(self) -> None:
        if not hasattr(self, "cm"):
            return
        pool = self.cm.pool
        n = pool.num_blocks
        refs = [0] * n
        for sid in self.live:
            for b in self.cm.block_table(sid):
                if b >= 0:
                    refs[b] += 1
        assert pool.ref == refs  # refcounts match the live tables (hence never negative)
        free = set(pool.free)
        assert len(free) == len(pool.free)  # no duplicates on the free list
        assert all(refs[b] == 0 and pool.hash[b] is None for b in free)  # free is never in use
        evictable = [b for b in range(n) if refs[b] == 0 and pool.hash[b] is not None]
        used = sum(1 for r in refs if r)
        assert len(free) + len(evictable) + used == n  # capacity never exceeded, nothing lost
        assert pool.num_evictable == len(evictable) == len(pool.policy)
        assert self.cm.num_used_blocks() == used and self.cm.num_free_blocks() == len(free) + len(evictable)
        assert {h: b for b, h in enumerate(pool.hash) if h is not None} == pool.index
        algo = self.cm.hash_algo
        for h, b in pool.index.items():  # hash table consistent with block contents
            salt, prefix = self.content[b]
            assert hash_full_blocks(list(prefix), self.bs, salt, algo)[-1] == h


def _machine(policy: str) -> type[CacheMachine]:
    return type(f"Machine_{policy}", (CacheMachine,), {"policy": policy})


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_random_operation_sequences(policy: str) -> None:
    machine = _machine(policy)
    machine.TestCase.settings = settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], database=None,
    )
    machine.TestCase().runTest()
