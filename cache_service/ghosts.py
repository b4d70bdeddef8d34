"""Ghost caches: one shadow KVCacheManager per candidate eviction policy, fed the same request
stream at the same capacity, so that "which policy would hit more right now" is measured, not
guessed. The manager is pure Python and a ghost only replays admissions (match -> allocate ->
cache -> free, back to back), so a ghost costs about one cache lookup per prompt block."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Sequence

from nanokv.cache_service.manager import KVCacheManager
from nanokv.messages import GhostScores


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


class _Evidence:
    def __init__(self, names: list[str], pairs: list[tuple[str, str]]) -> None:
        self.hits = dict.fromkeys(names, 0.0)
        self.pair_sq = dict.fromkeys(pairs, 0.0)
        self.queries = 0.0

    def add(self, got: dict[str, int], n: int) -> None:
        for p, h in got.items():
            self.hits[p] += h
        for a, b in self.pair_sq:
            d = got[a] - got[b]
            if d:
                self.pair_sq[(a, b)] += d * d
        self.queries += n

    def scores(self) -> GhostScores | None:
        return GhostScores(dict(self.hits), self.queries, dict(self.pair_sq)) if self.queries > 0 else None

    def scale(self, f: float) -> None:
        self.hits = {p: h * f for p, h in self.hits.items()}
        self.pair_sq = {k: v * f for k, v in self.pair_sq.items()}
        self.queries *= f


class GhostCaches:
    def __init__(self, policies: Iterable[str], capacity: int, block_size: int, lru_k: int = 2,
                 decay: float = 0.875) -> None:
        """Evidence is kept twice: for the last window only (reacts to a phase change at once) and
        decayed by ``decay`` per window (0.875: a horizon of about 8 windows, which is what a
        small but steady lead needs to become significant)."""
        self.capacity = capacity
        self.decay = decay
        self.caches = {p: KVCacheManager(capacity, block_size, eviction_policy=p, lru_k=lru_k)
                       for p in dict.fromkeys(policies)}
        names = list(self.caches)
        self._pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
        self._window = _Evidence(names, self._pairs)
        self._recent = _Evidence(names, self._pairs)
        self._last = self._window
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
        self._window.add(got, n)
        self._recent.add(got, n)

    def resize(self, capacity: int) -> None:
        """The live pool was resized: every ghost follows (between requests a ghost pins nothing, so
        a shrink always reaches ``capacity``; the removed blocks count as the ghost's evictions)."""
        for cm in self.caches.values():
            cm.resize(capacity)
        self.capacity = capacity

    def window_scores(self) -> tuple[GhostScores, GhostScores] | None:
        """(this window's evidence, the decayed recent evidence), or None when nothing was looked up
        in this window; then starts the next window."""
        window = self._window.scores()
        recent = self._recent.scores()
        self._last, self._window = self._window, _Evidence(list(self.caches), self._pairs)
        self._recent.scale(self.decay)
        if window is None or recent is None:
            return None
        return window, recent

    def restart_recent(self) -> None:
        """The workload changed phase: evidence from before the last window describes another
        workload, so the recent horizon restarts from the last window alone."""
        self._recent = self._last
        self._last = _Evidence(list(self.caches), self._pairs)
