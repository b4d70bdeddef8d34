"""Block sparsity in the cache service: one call per plan, after the plan's news.

A plan's news carries, per sequence, the tokens its last step computed (PlanRequest.commits, the
blocks they fill just published to the prefix cache) and, for the attention policies, the attention
mass each of its blocks got in a step (PlanRequest.block_scores: the compute service's step reply,
relayed by the gateway). For every commit of a sequence still held, in the request's order, this
folds the scores in, then applies the policy's plan through the cache manager:

  drop    the blocks go back to the pool; their entries become -1 holes (KVCacheManager.drop_blocks)
  demote  (hybrid) a slot of the INT4 demotion store is taken (DemotionSlots), the INT8 block goes
          back to the pool and the entry becomes -2 - slot (KVCacheManager.replace_with_external);
          the copy itself is the compute service's: PlanReply.demotions lists (block, slot), which
          the gateway passes on in the next StepRequest, and the compute service makes the copies
          first thing in that step, before its forward pass can write the block again

The table changes reach the compute service as table deltas like any other. So a sequence's blocks
go after each of its steps, before the next one runs, the same in one process and split.

Order (what a plan sees): with synchronous scheduling the plan after step N carries step N's
commits and scores. With async scheduling the plan for step N+1 is sent while step N runs, before
step N-1's reply is read: it carries step N-1's commits and step N-2's scores, so the ranking of
the attention policies lags one more step than the commits (the scores of a step are folded in at
the next plan, and rank at the one after). Both orders are fixed by the gateway's code, not by
timing, so a transport changes nothing: in process and over gRPC give the same tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from nanokv.cache_service.manager import KVCacheManager
from nanokv.cache_service.sparsity.slots import DemotionSlots
from nanokv.cache_service.sparsity.state import SequenceSparsity
from nanokv.messages import PlanReply, PlanRequest
from nanokv.sparsity import SparsityParams, demotion_slots, slot_code

_KEEP_PEAKS = 4096  # per-sequence peaks remembered (most recent sequences)


class CacheSparsity:
    def __init__(self, params: SparsityParams, manager: KVCacheManager) -> None:
        self.params = params
        self.cm = manager
        # (table, state): the table object tells a re-allocation (after a preemption) from the same run
        self._states: dict[int, tuple[list[int], SequenceSparsity]] = {}
        self.peak_blocks: OrderedDict[int, int] = OrderedDict()  # seq id -> most pool blocks held at once
        self.blocks_dropped = 0
        self.blocks_demoted = 0  # block demotions (each covers every layer)
        # demotions not done (the block stays INT8, retried after the next step): the block is shared
        # with another sequence (a prefix hit: moving it would free nothing) / the store was full
        self.demotions_refused = 0
        self.demotions_store_full = 0
        self.slots: DemotionSlots | None = None
        if params.demotes:
            self.slots = DemotionSlots(demotion_slots(params, manager.num_blocks))
            manager.set_external_release(self.slots.release_code)

    def _state(self, seq_id: int) -> SequenceSparsity:
        table = self.cm.block_table(seq_id)
        entry = self._states.get(seq_id)
        if entry is None or entry[0] is not table:  # new, or re-allocated after a preemption
            entry = (table, SequenceSparsity(self.params, self.cm.block_size))
            self._states[seq_id] = entry
        return entry[1]

    def after_news(self, req: PlanRequest, reply: PlanReply) -> None:
        """The plan's commits are published (the ended sequences are freed next): fold in the
        scores, then drop / demote after every commit; copies to make go into reply.demotions."""
        cm = self.cm
        ended = set(req.finished)
        for seq_id, mass in req.block_scores:
            if cm.has_seq(seq_id) and seq_id not in ended:
                self._state(seq_id).observe(mass)
        for seq_id, num_computed in req.commits:
            if not cm.has_seq(seq_id):
                continue
            held = sum(1 for b in cm.block_table(seq_id) if b >= 0)  # what its step ran with, before any drop
            self.peak_blocks[seq_id] = max(self.peak_blocks.pop(seq_id, 0), held)
            if seq_id not in ended:  # (an ended one's blocks all go back in this plan)
                self._apply(seq_id, self._state(seq_id), num_computed, reply)
        while len(self.peak_blocks) > _KEEP_PEAKS:
            self.peak_blocks.popitem(last=False)
        if len(self._states) > 2 * len(req.commits) + 64:  # forget ended sequences now and then
            self._states = {k: v for k, v in self._states.items() if cm.has_seq(k)}

    def _apply(self, seq_id: int, st: SequenceSparsity, num_computed: int, reply: PlanReply) -> None:
        plan = st.plan(num_computed)
        if not plan:
            return
        if plan.drop:
            self.cm.drop_blocks(seq_id, plan.drop)
            self.blocks_dropped += len(plan.drop)
        done = self._demote(seq_id, plan.demote, reply) if plan.demote and self.slots is not None else []
        st.commit(plan.drop, done)

    def _demote(self, seq_id: int, logical: list[int], reply: PlanReply) -> list[int]:
        """Move these blocks to INT4 store slots; returns the logical indices really moved."""
        assert self.slots is not None
        alone = self.cm.held_alone(seq_id, logical)
        self.demotions_refused += len(logical) - len(alone)
        slots = self.slots.take(len(alone))
        self.demotions_store_full += len(alone) - len(slots)
        done = alone[:len(slots)]
        table = self.cm.block_table(seq_id)
        for i, j in zip(done, slots):
            reply.demotions.append((table[i], j))  # the copy the compute service makes before b is reused
            self.cm.replace_with_external(seq_id, i, slot_code(j))
        self.blocks_demoted += len(done)
        return done

    def stats(self) -> dict[str, Any]:
        return {"policy": self.params.policy, "sparsity": self.params.sparsity,
                "blocks_dropped": self.blocks_dropped, "blocks_demoted": self.blocks_demoted,
                "demotions_refused": self.demotions_refused, "demotions_store_full": self.demotions_store_full,
                "demotion_slots": self.slots.num_slots if self.slots is not None else 0,
                "demotion_slots_free": self.slots.num_free() if self.slots is not None else 0,
                "max_peak_blocks": max(self.peak_blocks.values(), default=0)}
