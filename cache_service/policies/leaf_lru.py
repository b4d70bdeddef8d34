"""leaf_lru: LRU that learns which leaves of a prefix chain are dead and evicts them first.

Why (docs/cache-policies.md, "Why depth_lru lost, and what leaf_lru does instead"): a prompt's
blocks form a chain, and a request can only use a block if it uses every block before it. When a
multi-turn chat sends its next turn, it re-reads every *full* block of the previous turn, but never
the last one: that block held the partial end of the prompt, and the next turn's block at that
position holds more tokens, so its hash differs. In a chat trace about one new block in four is
such a dead leaf; plain LRU keeps it as long as the context in front of it. Everything else about
a multi-turn workload suits LRU: a conversation's blocks are all re-read together after the user's
think time, and the longer a conversation has been idle the less likely it is to come back.

How: blocks are released tail first (``tail`` = how many cached blocks of the releasing sequence
follow them, see base.py). A block released for the first time and never hit is in one of three
classes: the sequence's last block (``tail == 0``), the one before it (``tail == 1``) or an
interior one. For each class the policy measures how often a released block's content is requested
again within ``horizon`` releases (default: the capacity) - a hit while cached, or the same hash
being computed again after an eviction. The measurement does not depend on what the policy evicts
(a bigger cache would have seen the same requests), so a class that is judged dead stays judged on
the same evidence as the others. A leaf class whose reuse is below ``dead_ratio`` x the interior
class's is dead: its blocks go to a *cold* FIFO that is evicted before the LRU list; a hit moves a
block to the LRU list. Nothing else changes: every other block is plain LRU, and when no class is
dead the policy *is* LRU. Demoting only leaves keeps the cache ancestor-closed: a leaf has no cached
descendants that its eviction could orphan.

Counts are halved every ``halve_every`` outcomes (a phase change re-judges the classes); a class is
judged after ``min_trials`` outcomes.

Cost: O(1) per operation (two ordered dicts; a FIFO of open measurements, each expired once).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

from nanokv.cache_service.policies.base import EvictionPolicy, WarmBlock

LAST, BEFORE_LAST, INTERIOR = 0, 1, 2
CLASS_NAMES = ("last block", "block before the last", "interior block")


def leaf_class(tail: int) -> int:
    """Class of a never-hit block released ``tail`` blocks before its sequence's end (-1: unknown)."""
    return tail if tail in (LAST, BEFORE_LAST) else INTERIOR


class LeafLRUPolicy(EvictionPolicy):
    name = "leaf_lru"

    def __init__(self, capacity: int, dead_ratio: float = 0.25, min_trials: int = 32, halve_every: int = 2048,
                 horizon: int | None = None) -> None:
        super().__init__(capacity)
        self.dead_ratio = dead_ratio
        self.min_trials = min_trials
        self.halve_every = halve_every
        self._horizon_follows_capacity = horizon is None
        self.horizon = capacity if horizon is None else horizon
        self._cold: OrderedDict[int, None] = OrderedDict()  # dead-class blocks, evicted first (oldest first)
        self._lru: OrderedDict[int, None] = OrderedDict()  # everything else, LRU first
        self._key: dict[int, Hashable] = {}  # blocks released at least once and not forgotten
        self._reused: set[int] = set()  # blocks hit since they were computed
        # measurement: one open episode per released never-hit content (keyed by hash)
        self._now = 0  # releases so far
        self._pending: deque[tuple[int, Hashable]] = deque()  # (release time, key), oldest first
        self._open: dict[Hashable, tuple[int, int]] = {}  # key -> (release time, class)
        self._trials = [0.0, 0.0, 0.0]
        self._reuses = [0.0, 0.0, 0.0]
        self._outcomes = 0
        self.dead = [False, False, False]  # per class; INTERIOR is never dead (it is the reference)

    # ---- measurement ---------------------------------------------------------------------------
    def reuse_probability(self, cls: int) -> float | None:
        """Measured P(requested again within ``horizon`` releases) of a class, once judged."""
        return self._reuses[cls] / self._trials[cls] if self._trials[cls] >= self.min_trials else None

    def _close(self, key: Hashable, reused: bool) -> None:
        _, cls = self._open.pop(key)
        self._trials[cls] += 1.0
        if reused:
            self._reuses[cls] += 1.0
        self._outcomes += 1
        if self._outcomes >= self.halve_every:
            self._outcomes = 0
            self._trials = [t / 2 for t in self._trials]
            self._reuses = [r / 2 for r in self._reuses]
        ref = self.reuse_probability(INTERIOR)
        for c in (LAST, BEFORE_LAST):
            p = self.reuse_probability(c)
            self.dead[c] = p is not None and ref is not None and p < self.dead_ratio * ref

    def _expire(self) -> None:
        limit = self._now - self.horizon
        pending, open_ = self._pending, self._open
        while pending and pending[0][0] < limit:
            t, key = pending.popleft()
            got = open_.get(key)
            if got is not None and got[0] == t:
                self._close(key, False)

    # ---- contract --------------------------------------------------------------------------------
    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        self._now += 1
        if block_id not in self._key:  # computed (again): its first release
            self._key[block_id] = key
            if key in self._open:  # computed again within the horizon: a bigger cache would have hit
                self._close(key, True)
        if block_id in self._reused:
            self._lru[block_id] = None
            self._lru.move_to_end(block_id)
        else:
            cls = leaf_class(tail)
            if key not in self._open:
                self._open[key] = (self._now, cls)
                self._pending.append((self._now, key))
            if self.dead[cls]:
                self._cold[block_id] = None
            else:
                self._lru[block_id] = None
                self._lru.move_to_end(block_id)
        self._expire()

    def on_hit(self, block_id: int) -> None:
        self._reused.add(block_id)
        key = self._key.get(block_id)
        if key is not None and key in self._open:
            self._close(key, True)
        if self._cold.pop(block_id, 0) is None:  # evictable and cold: reused after all
            self._lru[block_id] = None
        elif block_id in self._lru:
            self._lru.move_to_end(block_id)

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        self._cold.pop(block_id, None)
        self._lru.pop(block_id, None)
        if forget:
            self._key.pop(block_id, None)
            self._reused.discard(block_id)

    def victim(self) -> int:
        queue = self._cold if self._cold else self._lru
        block_id, _ = queue.popitem(last=False)
        del self._key[block_id]
        self._reused.discard(block_id)
        return block_id

    def inherit(self, donor: EvictionPolicy | None, blocks: Sequence[WarmBlock]) -> None:
        """Warm start: the donor's measurement (per-class counts, open episodes, which classes are
        dead); a live block the donor holds goes where the donor has it (cold FIFO or LRU, reused)."""
        if not isinstance(donor, LeafLRUPolicy):
            return super().inherit(donor, blocks)
        self._now = donor._now
        self._pending = deque(donor._pending)
        self._open = dict(donor._open)
        self._trials, self._reuses = list(donor._trials), list(donor._reuses)
        self._outcomes, self.dead = donor._outcomes, list(donor.dead)
        cold = {donor._key[b] for b in donor._cold if b in donor._key}
        for b, key, _depth, reused in blocks:
            self._key[b] = key  # a block the donor does not hold goes to the LRU list, coldest
            (self._cold if key in cold and not reused else self._lru)[b] = None
            if reused:
                self._reused.add(b)
        return None

    def resize(self, capacity: int) -> None:
        super().resize(capacity)
        if self._horizon_follows_capacity:
            self.horizon = capacity

    def __len__(self) -> int:
        return len(self._cold) + len(self._lru)

    def snapshot(self) -> list[tuple[int, bool]]:
        return [(b, b in self._reused) for q in (self._cold, self._lru) for b in q]
