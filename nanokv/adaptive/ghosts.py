"""Ghost caches: one shadow KVCacheManager per candidate eviction policy, fed the same request
stream at the same capacity, so that "which policy would hit more right now" is measured, not
guessed. The manager is pure Python and a ghost only replays admissions (match -> allocate ->
cache -> free, back to back), so a ghost costs about one cache lookup per prompt block."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from nanokv.cache.manager import KVCacheManager


def replay_request(cm: KVCacheManager, key: Hashable, hashes: Sequence[bytes]) -> int:
    """One request through the calls the scheduler makes, with nothing else running; returns its
    prefix hit in blocks. Blocks beyond the pool are cut off (they could never all be resident).
    The query is one token longer than the blocks so the "leave one token to compute" cap never
    hides a full hit (the engine applies that cap before it hands hashes to the ghosts)."""
    n = min(len(hashes), cm.num_blocks)
    if n == 0:
        return 0
    hashes = hashes[:n]
    num_tokens = n * cm.block_size
    tokens = range(num_tokens + 1)
    match = cm.match_prefix(tokens, block_hashes=hashes)
    if cm.allocate(key, num_tokens, match) is None:  # only if the caller pinned blocks itself
        raise RuntimeError(f"{n} blocks do not fit in a pool of {cm.num_blocks}")
    cm.cache_blocks(key, tokens, num_tokens)
    cm.free(key)
    return len(match.block_ids)


@dataclass(frozen=True)
class GhostScores:
    """Recent evidence: decayed block hits per ghost over the same decayed queries, and for every
    pair of ghosts the decayed sum of squared per-request hit differences (for a paired test)."""

    hits: dict[str, float]
    queries: float
    pair_sq: dict[tuple[str, str], float]

    @property
    def ratios(self) -> dict[str, float]:
        return {p: h / self.queries for p, h in self.hits.items()}

    def z(self, a: str, b: str) -> float:
        """How many standard deviations ``a`` leads ``b`` by: both ghosts saw the very same requests,
        so the per-request differences d_i are paired and sum(d_i) / sqrt(sum(d_i^2)) is the
        statistic of a sign-free paired test; a lead of a few lucky requests scores low."""
        d = self.hits[a] - self.hits[b]
        sq = self.pair_sq.get((a, b), self.pair_sq.get((b, a), 0.0))
        return d / sq**0.5 if sq > 0 else 0.0


class GhostCaches:
    def __init__(self, policies: Iterable[str], capacity: int, block_size: int, lru_k: int = 2,
                 decay: float = 0.5) -> None:
        """decay: weight the evidence of earlier windows keeps at each window end (0 = this window
        only); 0.5 gives a horizon of about two windows, which smooths noise yet follows a phase."""
        self.capacity = capacity
        self.decay = decay
        self.caches = {p: KVCacheManager(capacity, block_size, eviction_policy=p, lru_k=lru_k)
                       for p in dict.fromkeys(policies)}
        names = list(self.caches)
        self._pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
        self._hits = dict.fromkeys(names, 0.0)
        self._pair_sq = dict.fromkeys(self._pairs, 0.0)
        self._queries = 0.0
        self._new_queries = 0
        self._keys = itertools.count()

    @property
    def policies(self) -> tuple[str, ...]:
        return tuple(self.caches)

    def observe(self, hashes: Sequence[bytes]) -> None:
        """One admitted request, as its full-block hashes (the blocks a prefix hit could cover)."""
        n = min(len(hashes), self.capacity)
        if n == 0:
            return
        key = next(self._keys)
        got = {p: replay_request(cm, key, hashes) for p, cm in self.caches.items()}
        for p, h in got.items():
            self._hits[p] += h
        for a, b in self._pairs:
            d = got[a] - got[b]
            if d:
                self._pair_sq[(a, b)] += d * d
        self._queries += n
        self._new_queries += n

    def window_scores(self) -> GhostScores | None:
        """The evidence up to now (None: no lookup in this window), then age it by ``decay``."""
        if self._new_queries == 0:
            return None
        out = GhostScores(dict(self._hits), self._queries, dict(self._pair_sq))
        f = self.decay
        self._hits = {p: h * f for p, h in self._hits.items()}
        self._pair_sq = {k: v * f for k, v in self._pair_sq.items()}
        self._queries *= f
        self._new_queries = 0
        return out
