"""Planner: one scheduling step's block work as one transaction on the cache manager.

The gateway's scheduler decides the order and the budgets; this applies them to the blocks in a
single call (nanokv.messages.PlanRequest), so a step costs one round trip to the cache service
however many sequences it touches. The decisions are those the scheduler made when it called the
cache manager directly: running sequences grow oldest first and the newest is preempted when
blocks run out; waiting ones are admitted in queue order with their prefix-cache hit, while the
token budget, the sequence limit and the blocks last, and never in a step that preempted.

The planner keeps what the cache needs to know of each sequence: its token ids (for prefix
hashing) and cache salt, and how much of its block table the compute service has already seen,
so that replies carry table deltas, not tables. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanokv.cache_service.manager import KVCacheManager
from nanokv.errors import NanoKVError
from nanokv.messages import PlanReply, PlanRequest, TableDelta

if TYPE_CHECKING:
    from nanokv.cache_service.sparsity.decide import CacheSparsity
    from nanokv.cache_service.tiers.hierarchy import LowerMatch
    from nanokv.cache_service.tiers.serving import ServingTiers


@dataclass
class _SeqState:
    token_ids: list[int]
    cache_salt: str | None
    sent: int = 0  # table entries the compute service holds (0 after a free: it drops its copy)
    owner: str = ""  # the gateway that registered it (PlanRequest.gateway_id)
    prompt_len: int = 0


class Planner:
    def __init__(self, manager: KVCacheManager, on_admit: Callable[[list[bytes]], None] | None = None,
                 tiers: ServingTiers | None = None):
        """on_admit: called with an admitted sequence's prompt block hashes, capped like a prefix match
        (the adaptive controller's ghost caches, nanokv.cache_service.ghosts, replay them).
        tiers: the lower tiers (cache_service/tiers/serving.py): a prefix hit goes on below L1."""
        self.manager = manager
        self.on_admit = on_admit
        self.tiers = tiers
        self._seqs: dict[int, _SeqState] = {}
        self.sparsity: CacheSparsity | None = None  # block sparsity (CacheService.attach sets it)

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    def _state(self, seq_id: int, what: str) -> _SeqState:
        st = self._seqs.get(seq_id)
        if st is None:
            raise NanoKVError(what, f"unknown sequence id {seq_id}")
        return st

    def plan(self, req: PlanRequest) -> PlanReply:
        cm = self.manager
        # ---- news since the last plan
        for ns in req.new_seqs:
            if ns.seq_id in self._seqs:
                raise NanoKVError("new_seqs", f"sequence id {ns.seq_id} is already registered")
            self._seqs[ns.seq_id] = _SeqState(list(ns.token_ids), ns.cache_salt, owner=req.gateway_id,
                                              prompt_len=len(ns.token_ids))
        for seq_id, tok in req.appended:
            self._state(seq_id, "appended").token_ids.append(tok)
        for seq_id, num_computed in req.commits:
            st = self._state(seq_id, "commits")
            if cm.has_seq(seq_id):
                cm.cache_blocks(seq_id, st.token_ids, num_computed, st.cache_salt)
        reply = PlanReply()
        if self.tiers is not None:
            self.tiers.begin_plan(req.copies_done)
        if self.sparsity is not None:  # drop / demote what the news says ran (after its commits published)
            self.sparsity.after_news(req, reply)
        for seq_id in req.finished:
            if self._seqs.pop(seq_id, None) is not None:
                cm.free(seq_id)
        if req.is_news_only:
            reply.used_blocks = cm.num_used_blocks()
            return reply

        # ---- running sequences, in the scheduler's order; preempt the newest when blocks run out
        running = list(req.running)
        for seq_id in running:
            self._state(seq_id, "running")
        preempted: set[int] = set()
        scheduled: list[int] = []
        used = 0
        for seq_id, target, n in req.grows:
            if seq_id in preempted:
                continue
            while not cm.grow(seq_id, target):
                victim = running[-1]
                if victim in scheduled:  # never preempt what is already in this batch
                    victim = seq_id
                self._preempt(victim, running, preempted, reply)
                if victim == seq_id:
                    break
            if seq_id in preempted:
                continue
            scheduled.append(seq_id)
            used += n

        # ---- admissions (not in a step that had to preempt: memory is tight)
        budget = req.token_budget - used
        if not preempted:
            for seq_id, num_tokens, computed_before in req.waiting:
                if budget <= 0 or len(running) >= req.max_num_seqs:
                    break
                st = self._state(seq_id, "waiting")
                tokens = st.token_ids[:num_tokens]
                prefix = cm.match_prefix(tokens, st.cache_salt)
                lower = self.tiers.begin(prefix) if self.tiers is not None else None
                if lower is not None and self.tiers is not None and self.tiers.loading:
                    self._cancel(lower)  # its disk hits are being read: it waits, the others go on
                    continue
                hit = prefix.num_tokens + (self.tiers.hit_blocks(lower) * cm.block_size
                                           if self.tiers is not None and lower is not None else 0)
                n = num_tokens - hit
                if n > budget:
                    if not req.chunked_prefill:
                        self._cancel(lower)
                        break
                    n = budget
                if cm.allocate(seq_id, hit + n, prefix, lower.resident() if lower is not None else None) is None:
                    self._cancel(lower)
                    break
                if lower is not None:
                    self._land(lower, seq_id, st, hit, reply)
                if computed_before:
                    cm.record_recompute(max(0, computed_before - hit))
                running.append(seq_id)
                scheduled.append(seq_id)
                reply.admitted.append((seq_id, hit, n))
                if self.on_admit is not None:  # the prompt's blocks, as the gateway-side ghosts see them
                    self.on_admit(prefix.block_hashes[:(st.prompt_len - 1) // cm.block_size])
                budget -= n

        # ---- table deltas for every sequence that runs
        for seq_id in scheduled:
            st = self._seqs[seq_id]
            table = cm.block_table(seq_id)
            start = st.sent
            changed = cm.changed_from(seq_id)
            if changed is not None:
                start = min(start, changed)
            if start < len(table) or len(table) < st.sent:
                start = min(start, len(table))
                reply.tables.append(TableDelta(seq_id, start, table[start:]))
            st.sent = len(table)
        reply.used_blocks = cm.num_used_blocks()
        if self.tiers is not None:
            reply.copies = self.tiers.take_copies()
            reply.copy_seq = self.tiers.plan_no if reply.copies else 0
        return reply

    def _cancel(self, lower: LowerMatch | None) -> None:
        if lower is not None and self.tiers is not None:
            self.tiers.cancel(lower)

    def _land(self, lower: LowerMatch, seq_id: int, st: _SeqState, hit: int, reply: PlanReply) -> None:
        """The blocks below L1 go into the sequence's fresh blocks (copies the step runs first) and
        are published in L1 now: no step reads them before those copies."""
        tiers = self.tiers
        if tiers is None or not tiers.hit_blocks(lower):
            if tiers is not None:
                tiers.finish(lower)
            return
        loaded = tiers.land(lower, self.manager.block_table(seq_id))
        disk, remote = tiers.from_disk(lower), tiers.from_remote()
        self.manager.cache_blocks(seq_id, st.token_ids, hit, st.cache_salt)
        tiers.finish(lower)
        reply.loaded.append((seq_id, loaded - disk - remote, disk, remote))

    def _preempt(self, seq_id: int, running: list[int], preempted: set[int], reply: PlanReply) -> None:
        running.remove(seq_id)
        self.manager.free(seq_id)
        self.manager.record_preemption()
        self._seqs[seq_id].sent = 0
        preempted.add(seq_id)
        reply.preempted.append(seq_id)

    def forget_all(self, owner: str | None = None) -> int:
        """Every sequence of `owner` (None: of every gateway) ends, its gateway went away: free the
        blocks they hold. Returns how many ended."""
        gone = [s for s, st in self._seqs.items() if owner is None or st.owner == owner]
        for seq_id in gone:
            self._seqs.pop(seq_id)
            self.manager.free(seq_id)
        return len(gone)
