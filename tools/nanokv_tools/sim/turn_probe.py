"""probe_turn: leaf_lru plus conversation ends learned by turn count (a headroom probe, simulator only).

Why (docs/cache-policies.md, "The headroom"): what Belady keeps beyond leaf_lru on chat is the
conversations that ended. With geometric turns - what ShareGPT's statistics allow when the end rate
does not rise with the turn count - how many turns a conversation has had says nothing about whether
it goes on. Those statistics do not rule out an end rate that *rises* with the turn count (the
extreme: every conversation has the same number of turns, as in the `multi_turn` toy). Then the turn
count announces the end, and this probe measures how much an online policy could make of that.

How turns are counted from block hashes alone: each released sequence's last two cached blocks of
its own content are its *ends*. The next turn re-reads the previous prompt, so its deepest block
that is an earlier sequence's end (still cached and hit, or computed again with the same hash)
continues that conversation: turn + 1, and the blocks it adds belong to the same conversation. An end
continues once; older ends are forgotten after ``anchor_span`` x ``horizon`` releases. A block that a
second conversation reads is shared and belongs to none. A turn whose own content fits in its partial
last block leaves no full block to re-read, so its next turn counts as a first one.

What is learned: per turn class (1 ... ``max_class``, the last one open-ended) the share of sequences
continued within ``horizon`` releases - whether the cache could have hit the next turn. A class whose
share is below ``dead_ratio`` x the share over all classes, after ``turn_min_trials`` outcomes, is
dead: a sequence of that class releases its conversation's own blocks (not the shared ones) into
leaf_lru's cold FIFO, deepest first, so the cache stays ancestor-closed. When no class is dead the
probe is leaf_lru. Cost: O(blocks released) per sequence, as leaf_lru.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable

from nanokv.cache_service.policies.leaf_lru import LeafLRUPolicy

SHARED = -1  # the conversation of a block that two conversations read


class TurnEndProbe(LeafLRUPolicy):
    name = "probe_turn"

    def __init__(self, capacity: int, max_class: int = 8, turn_min_trials: int = 16,
                 anchor_span: int = 16) -> None:
        super().__init__(capacity)
        self.max_class = max_class
        self.turn_min_trials = turn_min_trials
        self.anchor_span = anchor_span
        self._conv: dict[int, int] = {}  # cached block -> conversation (SHARED once two read it)
        self._next_conv = 0
        # end key -> (conversation, turn, release time, key of its measurement)
        self._ends: OrderedDict[Hashable, tuple[int, int, int, Hashable]] = OrderedDict()
        self._burst: list[int] = []  # the sequence being released, deepest block first
        self._burst_new: set[int] = set()  # ... and which of its blocks were computed for it
        # per turn class: sequences measured, and how many were continued within the horizon
        self._turn_open: dict[Hashable, tuple[int, int]] = {}  # measurement key -> (time, class)
        self._turn_pending: deque[tuple[int, Hashable]] = deque()
        self.turn_trials = [0.0] * (max_class + 1)
        self.turn_continued = [0.0] * (max_class + 1)
        self.turn_dead = [False] * (max_class + 1)
        self.demoted = 0

    # ---- measurement ---------------------------------------------------------------------------
    def _turn_close(self, key: Hashable, continued: bool) -> None:
        _, cls = self._turn_open.pop(key)
        self.turn_trials[cls] += 1.0
        self.turn_continued[cls] += continued
        total = sum(self.turn_trials)
        if total >= 2 * self.halve_every:
            self.turn_trials = [t / 2 for t in self.turn_trials]
            self.turn_continued = [c / 2 for c in self.turn_continued]
            total /= 2
        ref = sum(self.turn_continued) / total
        for c in range(1, self.max_class + 1):
            n = self.turn_trials[c]
            self.turn_dead[c] = n >= self.turn_min_trials and self.turn_continued[c] < self.dead_ratio * ref * n

    def _turn_expire(self) -> None:
        ends, limit = self._ends, self._now - self.anchor_span * self.horizon
        while ends and next(iter(ends.values()))[2] < limit:
            ends.popitem(last=False)
        pending, limit = self._turn_pending, self._now - self.horizon
        while pending and pending[0][0] < limit:
            t, key = pending.popleft()
            got = self._turn_open.get(key)
            if got is not None and got[0] == t:
                self._turn_close(key, False)

    # ---- one released sequence -------------------------------------------------------------------
    def _finish(self) -> None:
        """Classify the sequence whose blocks were just released (all of them are now known)."""
        if not self._burst:
            return
        burst, new = self._burst, self._burst_new
        self._burst, self._burst_new = [], set()
        conv: int | None = None
        turn = 1
        for b in burst:  # deepest first: the deepest earlier end is the turn this one continues
            end = self._ends.pop(self._key[b], None)
            if end is not None:
                conv, turn = end[0], end[1] + 1
                if end[3] in self._turn_open:
                    self._turn_close(end[3], True)
                break
        if conv is None:  # no earlier end re-read: a new conversation
            conv, self._next_conv = self._next_conv, self._next_conv + 1
        for b in burst:
            if b in new:
                self._conv[b] = conv
            elif self._conv.get(b, SHARED) != conv:
                self._conv[b] = SHARED
        own = [b for b in burst[:2] if self._conv[b] == conv]
        if own:
            cls = min(turn, self.max_class)
            measure = self._key[own[-1]]
            for b in own:
                self._ends[self._key[b]] = (conv, turn, self._now, measure)
                self._ends.move_to_end(self._key[b])
            if measure not in self._turn_open:
                self._turn_open[measure] = (self._now, cls)
                self._turn_pending.append((self._now, measure))
            if self.turn_dead[cls]:
                for b in burst:  # deepest first into the cold FIFO: children leave before parents
                    if self._conv[b] == conv and self._lru.pop(b, 0) is None:
                        self._cold[b] = None
                        self.demoted += 1
        self._turn_expire()

    # ---- contract ----------------------------------------------------------------------------------
    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        if tail <= 0:  # a sequence's deepest block (or one outside any sequence) starts a new release
            self._finish()
        if tail >= 0:
            self._burst.append(block_id)
            if block_id not in self._key:
                self._burst_new.add(block_id)
        super().on_evictable(block_id, key, depth, tail)

    def on_hit(self, block_id: int) -> None:
        self._finish()
        super().on_hit(block_id)

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        self._finish()
        super().on_remove(block_id, forget)
        if forget:
            self._conv.pop(block_id, None)

    def victim(self) -> int:
        self._finish()
        block_id = super().victim()
        self._conv.pop(block_id, None)
        return block_id
