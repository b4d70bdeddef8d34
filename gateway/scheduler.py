"""Continuous-batching scheduler. Pure Python: no torch, no model, no kernels.

Every step is rescheduled from scratch under two budgets, `max_num_seqs` sequences and
`max_num_batched_tokens` tokens. Running sequences go first (decodes and unfinished prefill
chunks, oldest first), then waiting ones are admitted with their prefix-cache hit. When blocks
run out, the newest running sequence is preempted by recompute: its blocks are released (they
stay cached, so a later prefix hit recovers most of the work) and it returns to the front of the
waiting queue.

The scheduler owns the queues, the budgets and each sequence's progress; the blocks belong to the
cache service. A step's block work goes to it as one transaction (`cache.plan`, a PlanRequest):
which running sequences must grow to how many tokens, in order, and which waiting ones may be
admitted; the reply says what was preempted and admitted, with each admission's prefix hit, and
carries the block-table changes for the compute service. What the cache must learn between steps
(new prompts, sampled tokens, computed blocks to publish, ended sequences, block sparsity's attention
scores) rides on the next plan; block sparsity's INT4 copies a reply asks for (PlanReply.demotions)
ride on the next step request (take_demotions).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanokv.gateway.sequence import SeqStatus, Sequence
from nanokv.messages import PLACEHOLDER, NewSeq, PlanReply, PlanRequest, TableDelta
from nanokv.service_api import CacheAPI, PendingPlan


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # query tokens this step: positions [num_computed, num_computed + n)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledSeq] = field(default_factory=list)  # query length may be 1 (last prompt token)
    decodes: list[ScheduledSeq] = field(default_factory=list)  # exactly one query token each
    preempted: list[Sequence] = field(default_factory=list)
    tables: list[TableDelta] = field(default_factory=list)  # block-table changes, for the compute service

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class _Planned:
    """A plan on its way: the running sequences it grows, and its reply once read."""
    __slots__ = ("picked", "pending", "reply")

    def __init__(self, picked: list[tuple[Sequence, int]], pending: PendingPlan):
        self.picked = picked
        self.pending = pending
        self.reply: PlanReply | None = None

    def wait(self) -> PlanReply:
        if self.reply is None:
            self.reply = self.pending.wait()
        return self.reply


class Scheduler:
    def __init__(self, cache: CacheAPI, *, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True):
        self.cache = cache
        self.max_num_seqs = max_num_seqs  # may be lowered at run time by the adaptive controller
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.used_blocks = 0  # blocks referenced after the last plan (the cache service says; a gauge)
        self.news = PlanRequest()  # what the cache service learns with the next plan
        self.plan_calls = 0
        self._ahead: _Planned | None = None  # the next step's plan, sent ahead (async scheduling)
        self._held: list[tuple[int, int]] = []  # commits waiting for the tokens they cover (update(hold=True))
        # the memory hierarchy's copies the plans asked for, in order, until a step carries them
        # (take_copies): a plan whose batch came out empty leaves its copies to the next step
        self.copies: list[tuple[int, int, int]] = []
        self.copy_seq = 0  # the last plan whose copies are in `copies`
        self.copies_done = 0  # the last plan whose copies a finished step ran (sent with every plan)
        # hybrid sparsity: (block, slot) copies the replies asked for, for the next step request, in order
        self.demotions: list[tuple[int, int]] = []

    # ---- queue management ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.news.new_seqs.append(NewSeq(seq.seq_id, list(seq.token_ids), seq.cache_salt))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def note_token(self, seq: Sequence, token_id: int) -> None:
        """A sampled token joined `seq` (the cache hashes full blocks of generated tokens too)."""
        self.news.appended.append((seq.seq_id, token_id))

    def finish(self, seq: Sequence) -> None:
        """Finished or aborted: its blocks go back with the next plan. (Async scheduling learns of a
        stop one step late, when the sequence may have been preempted.)"""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.status != SeqStatus.FINISHED:
            self.news.finished.append(seq.seq_id)
        seq.status = SeqStatus.FINISHED

    abort = finish

    def has_news(self) -> bool:
        n = self.news
        return bool(n.new_seqs or n.appended or n.commits or n.finished)

    def flush(self) -> None:
        """Send what the cache service must learn now (ended sequences' blocks back), outside a step."""
        self.settle()
        if self.has_news():
            req, self.news = self.news, PlanRequest()
            self.plan_calls += 1
            reply = self.cache.plan(req)
            self.used_blocks = reply.used_blocks
            self.demotions.extend(reply.demotions)

    def note_scores(self, scores: list[tuple[int, list[float]]]) -> None:
        """Block sparsity: a step's attention mass per block (StepResult.block_scores) goes to the
        cache service with the next plan."""
        self.news.block_scores.extend(scores)

    def take_demotions(self) -> list[tuple[int, int]]:
        """The INT4 copies the plans since the last step request asked for (StepRequest.demotions)."""
        out, self.demotions = self.demotions, []
        return out

    def _preempt(self, seq: Sequence, out: SchedulerOutput, count: bool = True) -> None:
        self.running.remove(seq)
        seq.computed_before_preemption = max(seq.computed_before_preemption, seq.num_computed_tokens)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += count
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def preempt_all(self) -> None:
        """Every running sequence back to waiting, oldest first, as a preemption would (a pool change:
        nanokv.gateway.repool). A plan sent ahead is dropped: it was made on the old pool. Not counted
        in num_preemptions: that counts memory pressure, which the adaptive controller reacts to."""
        self.settle()
        self._ahead, self._held = None, []
        out = SchedulerOutput()
        for seq in reversed(list(self.running)):
            self._preempt(seq, out, count=False)

    def requeue_all(self) -> None:
        """A new pool (nanokv.gateway.repool): running sequences back to the front of the queue, oldest
        first (preempt_all), and every sequence announced anew, as the new pool's cache service and the
        compute service know none of them. What the old pool's cache would have learned is dropped."""
        self.preempt_all()
        self.news = PlanRequest()
        self.demotions = []
        for seq in self.waiting:
            seq.params_sent = False  # the compute service forgot every sequence's sampling params
            self.news.new_seqs.append(NewSeq(seq.seq_id, list(seq.token_ids), seq.cache_salt))

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """This step's batch: the plan sent ahead (plan_ahead), or one planned now."""
        planned, self._ahead = self._ahead, None
        if planned is None:
            planned = self._send({})
        return self._apply(planned) if planned is not None else SchedulerOutput()

    def plan_ahead(self, pending: dict[int, int]) -> None:
        """Async scheduling: send the next step's plan now, while the device runs this one and the
        host waits for the step before it. `pending` counts, per sequence, the placeholder tokens it
        will get before that step (its sample of the step just launched). Sequences that stop on the
        token still in flight are in this plan; they are dropped from the batch when it is applied."""
        self._ahead = self._send(pending)

    def settle(self) -> None:
        """Wait for a plan sent ahead (its reply is kept for the next schedule): before any other
        call to the cache service, which must see them in order."""
        if self._ahead is not None:
            self._ahead.wait()

    def _send(self, pending: dict[int, int]) -> _Planned | None:
        budget = self.max_num_batched_tokens
        req, self.news = self.news, PlanRequest()
        req.token_budget = budget
        req.max_num_seqs = self.max_num_seqs
        req.copies_done = self.copies_done
        req.chunked_prefill = self.enable_chunked_prefill
        req.running = [s.seq_id for s in self.running]

        # 1. running sequences, oldest first, each with its share of the token budget
        picked: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if budget <= 0:
                break
            todo = seq.num_uncomputed + pending.get(seq.seq_id, 0)
            n = min(todo, budget)
            if n == 0:  # async scheduling: its last token is still being sampled, and it is its last
                continue
            if n < todo and not self.enable_chunked_prefill:
                continue
            picked.append((seq, n))
            req.grows.append((seq.seq_id, seq.num_computed_tokens + n, n))
            budget -= n
        # 2. waiting candidates: each admission takes at least one token and one sequence slot
        room = min(budget, self.max_num_seqs - len(self.running))
        for seq in list(self.waiting)[:max(room, 0)]:
            if seq.token_ids[-1] == PLACEHOLDER:  # preempted with a sample in flight: the cache has not
                break  # its token yet (a plan sent ahead); it and those behind it wait for the next plan
            req.waiting.append((seq.seq_id, seq.num_tokens, seq.computed_before_preemption))
        if not req.grows and not req.waiting:
            self.news = req  # nothing to run: the news waits for the next plan
            req.running = []
            return None
        self.plan_calls += 1
        # the gRPC client: a future; in process: planned at once
        return _Planned(picked, self.cache.plan_async(req))

    def _apply(self, planned: _Planned) -> SchedulerOutput:
        """The reply applied. A plan sent ahead may name sequences that stopped (or were aborted)
        since: they are not run, and their blocks go back with the next plan (they are finished)."""
        out = SchedulerOutput()
        reply = planned.wait()
        self.used_blocks = reply.used_blocks
        if reply.copies:
            self.copies.extend(reply.copies)
            self.copy_seq = reply.copy_seq
        loaded = {seq_id: (l2, l3, rem) for seq_id, l2, l3, rem in reply.loaded}
        self.demotions.extend(reply.demotions)
        by_id = {s.seq_id: s for s in self.running}
        for seq_id in reply.preempted:
            seq = by_id.get(seq_id)
            if seq is not None:
                self._preempt(seq, out)
        gone = set(reply.preempted)
        left = False  # a sequence the plan runs has stopped or was aborted since it was sent
        for seq, n in planned.picked:
            if seq.seq_id not in gone:
                if seq.status == SeqStatus.RUNNING:
                    self._emit(out, seq, n)
                else:
                    left = True
        waiting = {s.seq_id: s for s in self.waiting}
        for seq_id, hit, n in reply.admitted:
            seq = waiting.get(seq_id)
            if seq is None:
                left = True
                continue
            self.waiting.remove(seq)
            seq.num_computed_tokens = hit
            if not seq.ever_scheduled:
                seq.num_cached_tokens = hit
                seq.ever_scheduled = True
                if seq_id in loaded:  # part of the hit came from the lower tiers
                    l2, l3, rem = loaded[seq_id]
                    seq.cached_tokens_by_tier = {"L1": hit - l2 - l3 - rem, "L2": l2, "L3": l3, "remote": rem}
            seq.computed_before_preemption = 0
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._emit(out, seq, n)
        out.tables = reply.tables
        if left:  # the compute service must not get the tables of sequences that left back
            ids = {s.seq.seq_id for s in out.scheduled}
            out.tables = [d for d in reply.tables if d.seq_id in ids]
        return out

    def take_copies(self) -> tuple[list[tuple[int, int, int]], int]:
        """The copies for the step about to be sent (it runs them before its forward pass), and the
        last plan they come from (0: none); `copies_ran` reports it once that step is done."""
        out, self.copies = self.copies, []
        return out, self.copy_seq if out else 0

    def copies_ran(self, seq: int) -> None:
        self.copies_done = max(self.copies_done, seq)

    def _emit(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        item = ScheduledSeq(seq, n)
        is_decode = n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
        (out.decodes if is_decode else out.prefills).append(item)

    def update(self, out: SchedulerOutput, hold: bool = False) -> None:
        """After the forward pass: advance computed counts; the cache publishes the full blocks
        with the next plan. `hold` (async scheduling, before the step in flight's tokens are read):
        the commits wait for release_commits, since they cover tokens the cache has not been sent."""
        commits = self._held if hold else self.news.commits
        for item in out.scheduled:
            seq = item.seq
            if seq.status != SeqStatus.RUNNING:
                continue  # async scheduling: stopped (blocks already freed) while this step ran
            seq.num_computed_tokens += item.num_new_tokens
            commits.append((seq.seq_id, seq.num_computed_tokens))

    def release_commits(self) -> None:
        self.news.commits.extend(self._held)
        self._held = []
