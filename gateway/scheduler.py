"""Continuous-batching scheduler. Pure Python: no torch, no model, no kernels.

Every step is rescheduled from scratch under two budgets, `max_num_seqs` sequences and
`max_num_batched_tokens` tokens. Running sequences go first (decodes and unfinished prefill
chunks, oldest first), then waiting ones are admitted with their prefix-cache hit. When blocks
run out, the newest running sequence is preempted by recompute: its blocks are released (they
stay cached, so a later prefix hit recovers most of the work) and it returns to the front of the
waiting queue. The scheduler decides *which* tokens run and *where* their KV lives; the runner
turns that into tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanokv.cache_service.manager import KVCacheManager
from nanokv.gateway.sequence import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # query tokens this step: positions [num_computed, num_computed + n)
    block_table: list[int]

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledSeq] = field(default_factory=list)  # query length may be 1 (last prompt token)
    decodes: list[ScheduledSeq] = field(default_factory=list)  # exactly one query token each
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, cache: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True):
        self.cache = cache
        self.max_num_seqs = max_num_seqs  # may be lowered at run time by the adaptive controller
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue management ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.cache.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def finish(self, seq: Sequence) -> None:
        # async scheduling learns of a stop one step late, when the sequence may have been preempted
        if seq in self.running:
            self.running.remove(seq)
            self.cache.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.computed_before_preemption = max(seq.computed_before_preemption, seq.num_computed_tokens)
        self.cache.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.cache.record_preemption()
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        # 1. running sequences, oldest first; preempt the newest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            if n == 0:  # async scheduling: its last token is still being sampled, and it is its last
                i += 1
                continue
            if n < seq.num_uncomputed and not self.enable_chunked_prefill:
                i += 1
                continue
            target = seq.num_computed_tokens + n
            while not self.cache.grow(seq.seq_id, target):
                victim = self.running[-1]
                if victim.seq_id in scheduled_ids:  # never preempt what is already in this batch
                    victim = seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SeqStatus.RUNNING:
                continue  # seq itself was preempted; self.running shrank, i stays
            self._emit(out, seq, n)
            scheduled_ids.add(seq.seq_id)
            budget -= n
            i += 1

        # 2. admit waiting sequences (not in a step that had to preempt: memory is tight)
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = self.cache.match_prefix(seq.token_ids, seq.cache_salt)
            n = seq.num_tokens - prefix.num_tokens
            if n > budget:
                if not self.enable_chunked_prefill:
                    break
                n = budget
            table = self.cache.allocate(seq.seq_id, prefix.num_tokens + n, prefix)
            if table is None:
                break
            self.waiting.popleft()
            seq.num_computed_tokens = prefix.num_tokens
            if not seq.ever_scheduled:
                seq.num_cached_tokens = prefix.num_tokens
                seq.ever_scheduled = True
            if seq.computed_before_preemption:
                redo = max(0, seq.computed_before_preemption - prefix.num_tokens)
                self.cache.record_recompute(redo)
                seq.computed_before_preemption = 0
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._emit(out, seq, n)
            scheduled_ids.add(seq.seq_id)
            budget -= n
        return out

    def _emit(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        item = ScheduledSeq(seq, n, self.cache.block_table(seq.seq_id))
        is_decode = n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
        (out.decodes if is_decode else out.prefills).append(item)

    def update(self, out: SchedulerOutput) -> None:
        """After the forward pass: advance computed counts and publish full blocks to the cache."""
        for item in out.scheduled:
            seq = item.seq
            if seq.status != SeqStatus.RUNNING:
                continue  # async scheduling: stopped (blocks already freed) while this step ran
            seq.num_computed_tokens += item.num_new_tokens
            self.cache.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.cache_salt)
