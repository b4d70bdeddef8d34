"""Replay one trace through one KVCacheManager (one policy, one capacity).

The replay model (docs/cache-policies.md, "Replay model"): requests in trace order, one at a time;
each request's hash ids go through exactly the calls the scheduler makes -

    match_prefix(block_hashes=...) -> allocate -> cache_blocks -> free (tail first)

A request's hits are the leading run of resident ids at arrival. Every trace block (also the partial
last one) is treated as a full cacheable block, and the query gets one extra token so that the
"leave one token to compute" cap never hides a full hit. A request longer than the pool can hold
(n > capacity blocks) is cut to its first ``capacity`` blocks; the cut blocks count as misses.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from nanokv.cache_service.manager import KVCacheManager
from nanokv.cache_service.policies import PolicyCaveatWarning
from nanokv.cache_service.policies.base import EvictionPolicy
from nanokv_tools.sim.traces import TraceRequest


@dataclass
class ReplayResult:
    policy: str
    capacity: int
    block_hits: int
    block_total: int
    token_hits: int
    token_total: int
    evictions: int
    seconds: float

    @property
    def block_hit_ratio(self) -> float:
        return self.block_hits / self.block_total if self.block_total else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.token_hits / self.token_total if self.token_total else 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        d: dict[str, float | int | str] = dict(asdict(self))
        d["block_hit_ratio"] = self.block_hit_ratio
        d["token_hit_ratio"] = self.token_hit_ratio
        return d


def block_tokens(req: TraceRequest, block_size: int) -> list[int]:
    """Tokens per trace block: full blocks, the last one holding the remainder."""
    n = len(req.hash_ids)
    if n == 0:
        return []
    last = req.input_length - block_size * (n - 1)
    return [block_size] * (n - 1) + [max(1, min(block_size, last))]


class NextUseOracle:
    """Future knowledge for Belady: the index of the next request (after ``now``) using a key.

    Per key a sorted list of the requests that use it and a cursor; time only moves forward, so each
    query is amortized O(1)."""

    def __init__(self, keyed_requests: Sequence[Sequence[bytes]]) -> None:
        self.now = -1
        self._uses: dict[bytes, list[int]] = {}
        for i, keys in enumerate(keyed_requests):
            for k in keys:
                uses = self._uses.setdefault(k, [])
                if not uses or uses[-1] != i:
                    uses.append(i)
        self._cursor: dict[bytes, int] = {}

    def __call__(self, key: object) -> float:
        uses = self._uses.get(key)  # type: ignore[call-overload]
        if uses is None:
            return float("inf")
        c = self._cursor.get(key, 0)  # type: ignore[call-overload]
        while c < len(uses) and uses[c] <= self.now:
            c += 1
        self._cursor[key] = c  # type: ignore[index]
        return float(uses[c]) if c < len(uses) else float("inf")


def keys_of(requests: Sequence[TraceRequest]) -> list[list[bytes]]:
    """Trace ids as the manager's hash keys (8-byte little-endian ids; the trace already chains)."""
    return [[h.to_bytes(8, "little", signed=True) for h in r.hash_ids] for r in requests]


def sim_manager(capacity: int, block_size: int, policy: str, *, lru_k: int = 2,
                policy_kwargs: dict[str, Any] | None = None) -> KVCacheManager:
    """A KVCacheManager for a replay. The simulator replays retired policies on purpose, to compare
    them: their warning is left out here (``nanokv simulate`` states every caveat once in its summary)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyCaveatWarning)
        return KVCacheManager(capacity, block_size, eviction_policy=policy, lru_k=lru_k, policy_kwargs=policy_kwargs)


def admitted(requests: Sequence[TraceRequest], keys: Sequence[Sequence[bytes]], block_size: int, capacity: int,
             oracle: NextUseOracle | None, totals: list[int]) -> Iterator[tuple[int, Sequence[bytes], int, list[int]]]:
    """The replay model's requests, one at a time: (index, the hashes that fit the cache, their tokens,
    every block's token count).
    Adds every request's blocks and tokens to totals ([blocks, tokens]), fitting or not, and moves the
    Belady oracle's clock. Shared by the single-tier and the tiered replay."""
    for i, (req, hashes) in enumerate(zip(requests, keys)):
        if oracle is not None:
            oracle.now = i
        sizes = block_tokens(req, block_size)
        totals[0] += len(sizes)
        totals[1] += sum(sizes)
        n = min(len(hashes), capacity)
        if n:
            yield i, hashes[:n], n * block_size, sizes


def replay(
    requests: Sequence[TraceRequest],
    policy: str,
    capacity: int,
    block_size: int = 512,
    *,
    lru_k: int = 2,
    keys: Sequence[Sequence[bytes]] | None = None,
    build: Callable[[int, Callable[[Hashable], float]], EvictionPolicy] | None = None,
) -> ReplayResult:
    """``build(capacity, next_use)``, when given, makes a simulator-only policy that is not in the
    registry (the oracles and probes of ``nanokv_tools.sim.headroom``); ``policy`` is then only its label."""
    t0 = time.perf_counter()
    keys = keys_of(requests) if keys is None else keys
    kwargs: dict[str, object] = {}
    oracle = None
    if policy == "belady" or build is not None:
        oracle = NextUseOracle(keys)
        kwargs["oracle"] = oracle
    if build is None:
        cm = sim_manager(capacity, block_size, policy, lru_k=lru_k, policy_kwargs=kwargs)
    else:
        assert oracle is not None  # narrowing: built just above
        cm = KVCacheManager(capacity, block_size, eviction_policy="lru")
        cm.pool.policy = build(capacity, oracle)  # nothing is cached yet: the LRU placeholder holds no state
    b_hits = t_hits = 0
    totals = [0, 0]
    for i, hashes, num_tokens, sizes in admitted(requests, keys, block_size, capacity, oracle, totals):
        match = cm.match_prefix(range(num_tokens + 1), block_hashes=hashes)
        table = cm.allocate(i, num_tokens, match)
        if table is None:  # cannot happen: nothing else is pinned between requests
            raise RuntimeError(f"request {i}: {len(hashes)} blocks do not fit in {capacity}")
        k = len(match.block_ids)
        b_hits += k
        t_hits += sum(sizes[:k])
        cm.cache_blocks(i, range(num_tokens), num_tokens)
        cm.free(i)
    b_total, t_total = totals
    return ReplayResult(policy, capacity, b_hits, b_total, t_hits, t_total, cm.stats.evictions,
                        time.perf_counter() - t0)


def replay_prompts(prompts: Sequence[Sequence[int]], policy: str, num_blocks: int, block_size: int,
                   **policy_kwargs: object) -> tuple[float, KVCacheManager]:
    """Token-level replay: the calls the engine's cache service makes for requests that run one at a
    time and generate one token each (``max_num_seqs=1``, ``max_tokens=1``): match_prefix(prompt) ->
    allocate(len(prompt)) -> cache_blocks(prompt) -> free. Unlike ``replay`` (the trace model, where a
    partial last block counts as a cacheable block), only full blocks are cached and at least one
    token is always left to compute, as in the engine. Returns the token hit ratio the engine reports
    (``prefix_hits_tokens / prefix_queries_tokens``) and the manager."""
    cm = sim_manager(num_blocks, block_size, policy, policy_kwargs=dict(policy_kwargs))
    for i, prompt in enumerate(prompts):
        m = cm.match_prefix(prompt)
        if cm.allocate(i, len(prompt), m) is None:
            raise RuntimeError(f"prompt {i}: {len(prompt)} tokens do not fit in {num_blocks} blocks")
        cm.cache_blocks(i, prompt, len(prompt))
        cm.free(i)
    st = cm.stats
    return (st.prefix_hits_tokens / st.prefix_queries_tokens if st.prefix_queries_tokens else 0.0), cm


def ideal(requests: Sequence[TraceRequest], block_size: int = 512) -> tuple[float, float]:
    """Infinite cache: (block hit ratio, token hit ratio) of leading runs of previously seen ids."""
    seen: set[int] = set()
    bh = bt = th = tt = 0
    for req in requests:
        sizes = block_tokens(req, block_size)
        k = 0
        while k < len(req.hash_ids) and req.hash_ids[k] in seen:
            k += 1
        bh += k
        th += sum(sizes[:k])
        bt += len(sizes)
        tt += sum(sizes)
        seen.update(req.hash_ids)
    return (bh / bt if bt else 0.0, th / tt if tt else 0.0)
