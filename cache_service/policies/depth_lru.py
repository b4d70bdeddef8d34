"""depth_lru: LRU that learns which positions of a prefix are worth keeping. RETIRED: use leaf_lru.

Retired (issue #38, docs/cache-policies.md "Why depth_lru lost"): it was tuned on the Mooncake
synthetic trace and loses to LRU on multi-turn chat (0.66x on a held-out real trace at 5%; 0.95x
on the ``conversation`` workload at 1%). Two flaws: it compares every class with the *best* class
(the hot shared prompts), so a new conversation turn, which comes back only after the user's think
time, is judged cold and evicted before stale reused blocks; and it measures reuse through a ghost
list that starts at eviction, so a class once judged cold is evicted sooner, observed for less
time and judged colder still. ``leaf_lru`` keeps its one sound idea (the last block of a released
prompt is usually dead) and drops both. Kept, with a PolicyCaveatWarning, so that configurations
naming it still load.

Why: in LLM prefix workloads a block's value depends on where it sat in the sequence that released
it. On the Mooncake trace the deepest block of a request is reused 5% of the time versus ~45-85% for
the others (it holds the question that ends the prompt: the next turn extends it, so its hash
changes), and a block already reused once is reused again ~80% of the time. Plain LRU gives that
dead tail block as much time in the cache as the document before it.

How: each release puts the block in a class = (distance from the releasing sequence's tail: 0, 1,
>= 2 or unknown) x (reused before: no / yes). The policy learns, per class, the probability that a
released block is requested again ("episode" outcomes: a hit while cached, or the key coming back
while it is still in a bounded ghost list of evicted keys = a hit a bigger cache would have had; a
ghost that ages out is a miss). Counts decay (halved every ``horizon`` outcomes) so the policy
follows phase changes. A block whose class is clearly worse than the best class (p < ``cold_ratio``
x best) enters a *cold* LRU list that is evicted before the normal (*warm*) LRU list; a hit moves a
block to warm. Everything else is LRU with tail-first release, so the cache stays ancestor-closed
(a deeper block never outlives its parent) and a block is never kept without its prefix.

It is scan resistant for free: during a stream of long one-off documents the "not reused" classes
turn cold and the reused system prompts in the warm list survive.

Cost: O(1) per operation (two ordered dicts, a ghost ordered dict, six counters).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from nanokv.cache_service.policies.base import EvictionPolicy

_TAIL_BUCKETS = 3  # tail distance 0, 1, >= 2 (unknown counts as interior)


def _class_of(tail: int, reused: bool) -> int:
    bucket = _TAIL_BUCKETS - 1 if tail < 0 else min(tail, _TAIL_BUCKETS - 1)
    return bucket + (_TAIL_BUCKETS if reused else 0)


class DepthLRUPolicy(EvictionPolicy):
    name = "depth_lru"

    def __init__(
        self, capacity: int, cold_ratio: float = 0.3, horizon: int = 1024, min_trials: int = 32
    ) -> None:
        super().__init__(capacity)
        self.cold_ratio = cold_ratio
        self.horizon = horizon
        self.min_trials = min_trials
        n = 2 * _TAIL_BUCKETS
        self._hits = [0.0] * n
        self._trials = [0.0] * n
        self._known = [False] * n  # a class is judged once it has min_trials outcomes, then forever
        self._cold_class = [False] * n
        self._cls: dict[int, int] = {}  # evictable block -> class it was queued under
        self._outcomes = 0
        self._cold: OrderedDict[int, None] = OrderedDict()  # evicted first, LRU first
        self._warm: OrderedDict[int, None] = OrderedDict()
        self._key: dict[int, Hashable] = {}
        self._reused: set[int] = set()
        self._episode: dict[int, int] = {}  # block -> class of its open release episode
        self._ghost: OrderedDict[Hashable, int] = OrderedDict()  # evicted key -> open episode class

    # ---- learning --------------------------------------------------------------------------------
    def _outcome(self, cls: int, hit: bool) -> None:
        self._trials[cls] += 1.0
        if self._trials[cls] >= self.min_trials:
            self._known[cls] = True
        if hit:
            self._hits[cls] += 1.0
        self._outcomes += 1
        if self._outcomes >= self.horizon:  # exponential forgetting, O(classes) every horizon
            self._outcomes = 0
            self._hits = [h / 2 for h in self._hits]
            self._trials = [t / 2 for t in self._trials]
        # Re-judge the classes here (O(classes) per outcome) so that the per-block hot paths
        # only read a flag.
        probs = [self.reuse_probability(c) for c in range(len(self._trials))]
        best = max((q for q in probs if q is not None), default=None)
        self._cold_class = [q is not None and best is not None and q < self.cold_ratio * best for q in probs]

    def reuse_probability(self, cls: int) -> float | None:
        return self._hits[cls] / self._trials[cls] if self._known[cls] else None

    def _is_cold(self, cls: int) -> bool:
        return self._cold_class[cls]

    # ---- contract --------------------------------------------------------------------------------
    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        if block_id not in self._key:
            self._key[block_id] = key
            ghost_cls = self._ghost.pop(key, None)
            if ghost_cls is not None:  # recomputed while remembered: a bigger cache would have hit
                self._outcome(ghost_cls, True)
        cls = _class_of(tail, block_id in self._reused)
        self._episode[block_id] = cls
        self._cls[block_id] = cls
        (self._cold if self._is_cold(cls) else self._warm)[block_id] = None

    def on_hit(self, block_id: int) -> None:
        self._reused.add(block_id)
        cls = self._episode.pop(block_id, None)
        if cls is not None:
            self._outcome(cls, True)
        if block_id in self._cold or block_id in self._warm:  # evictable: now reused, to warm MRU
            self._cold.pop(block_id, None)
            self._cls[block_id] = self._cls[block_id] % _TAIL_BUCKETS + _TAIL_BUCKETS
            self._warm[block_id] = None
            self._warm.move_to_end(block_id)

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        self._cold.pop(block_id, None)
        self._warm.pop(block_id, None)
        self._cls.pop(block_id, None)
        if forget:
            self._key.pop(block_id, None)
            self._reused.discard(block_id)
            self._episode.pop(block_id, None)

    def victim(self) -> int:
        # The oldest warm block goes first if its class has turned cold since it was queued (phase
        # change: without this, stale warm blocks would outlive every new block forever).
        warm_head_cold = bool(self._warm) and self._is_cold(self._cls[next(iter(self._warm))])
        queue = self._cold if self._cold and not warm_head_cold else self._warm
        b, _ = queue.popitem(last=False)
        del self._cls[b]
        key = self._key.pop(b)
        self._reused.discard(b)
        cls = self._episode.pop(b, None)
        if cls is not None:
            self._ghost[key] = cls
            if len(self._ghost) > self.capacity:
                _, old_cls = self._ghost.popitem(last=False)
                self._outcome(old_cls, False)
        return b

    def __len__(self) -> int:
        return len(self._cold) + len(self._warm)

    def snapshot(self) -> list[tuple[int, bool]]:
        return [(b, b in self._reused) for q in (self._cold, self._warm) for b in q]
