"""Async scheduling: the host prepares and launches step N+1 while the device still runs step N.

A synchronous step waits for its sampled tokens (a device sync) before the host can schedule the
next one, so every step pays schedule + metadata + postprocess on the host (about 2 ms at batch
256, a quarter of a decode step on an H200). Here a step launches its forward pass and sampling,
starts copying the sampled ids to pinned host memory, and only then finishes the *previous* step,
whose copy is done by now:
  - each sampling sequence gets a placeholder token at launch; the next step schedules it like a
    real token and the runner feeds the sampled id from the device tensor into that input slot;
  - a stop (EOS, stop string, stop id) is seen one step late: the stopped sequence has computed one
    token too many, which is dropped, so outputs are exact. Its blocks are freed then; only later
    launches can reuse them, and the stream runs those after the write;
  - a length limit is known ahead: a sequence on its last token gets no placeholder, so it is not
    scheduled again.
  - the next step's plan goes to the cache service right after this step launches, before the
    previous step's tokens are read (Scheduler.plan_ahead): over gRPC its round trip then overlaps
    the wait for the device. A sequence that stops on those tokens is in that plan; it is dropped
    from the batch when the reply is applied, and its blocks go back with the plan after.
Steps whose requests want logprobs sample synchronously (the logprob tensors are read at once).

Block sparsity keeps its order: the cache service drops and demotes a sequence's blocks when a plan
carries the commits of a step that ran it, ranking by the attention scores the plans so far carried
(nanokv.cache_service.sparsity.decide). Here step N+1's plan leaves while step N runs and before step
N-1's reply is read, so it carries step N-1's commits and step N-2's scores: the attention policies
rank by scores one step older than under synchronous scheduling (the drops themselves still follow
each step's commits); that costs no wait and no extra call. The order is the code's, not the clock's, so the
tokens are the same in one process and over gRPC. The INT4 copies a plan asks for go with the next
step request and run on the device's stream before that step's forward pass, after the step in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanokv.gateway.sequence import Sequence
from nanokv.messages import PLACEHOLDER
from nanokv.service_api import PendingStep

if TYPE_CHECKING:
    from nanokv.gateway.engine import Engine
    from nanokv.gateway.outputs import RequestOutput


@dataclass
class Pending:
    """A launched step whose sampled tokens the host has not read yet."""
    seqs: list[Sequence]
    placeholder: list[bool]  # row got a placeholder token (else: its last, it finishes by length)
    launched: PendingStep  # the compute service's handle (ComputeAPI.launch)


class AsyncStepper:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.pending: Pending | None = None

    def _finish(self, prev: Pending, finished_only: bool) -> list[RequestOutput]:
        """Read `prev`'s tokens (its copy is complete or nearly) and run the usual per-token logic."""
        eng = self.engine
        t0 = time.perf_counter()
        res = eng.compute.collect(prev.launched)
        eng.stepped(res.step_id)
        t1 = time.perf_counter()
        eng.rpc["step_s"] += t1 - t0  # the wait the pipeline did not hide
        eng.scheduler.note_scores(res.block_scores)  # block sparsity: with the next plan sent (see the docstring)
        outputs = []
        for seq, ph, tok in zip(prev.seqs, prev.placeholder, res.token_ids):
            if seq.is_finished:
                continue  # aborted, or stopped: this was the token one too many
            o = eng.on_token(seq, tok, None, finished_only, replace=ph)
            if o is not None:
                outputs.append(o)
        eng.rpc["tokens_s"] += time.perf_counter() - t1
        return outputs

    def land(self) -> list[RequestOutput]:
        """Finish the step in flight now and wait for the plan sent ahead (returns the step's
        outputs): before anything changes the KV tensors or the pool under them (a repool, the
        in-process adaptive controller's width and pool rules). The next step then runs as a
        synchronous one would; pipelining resumes after it."""
        outputs: list[RequestOutput] = []
        if self.pending is not None:
            prev, self.pending = self.pending, None
            outputs = self._finish(prev, False)
        self.engine.scheduler.settle()
        return outputs

    def step(self, finished_only: bool) -> list[RequestOutput]:
        eng = self.engine
        out = eng.schedule()
        prev, self.pending = self.pending, None
        if out.is_empty:
            return self._finish(prev, finished_only) if prev is not None else []
        sched = out.scheduled
        t0 = time.perf_counter()
        req = eng.step_request(out)
        eng.rpc["build_s"] += time.perf_counter() - t0
        seqs = [sched[r].seq for r in req.sample_rows]
        sync = any(s.params.logprobs is not None for s in seqs)
        t0 = time.perf_counter()
        launched = eng.compute.launch(req)  # sampled ids stay on the device for the next step's inputs
        eng.rpc["step_s"] += time.perf_counter() - t0
        eng.rpc["steps"] += 1
        eng.rpc["step_calls"] += 1
        if sync:
            outputs = self._finish(prev, finished_only) if prev is not None else []  # overlaps the device
            eng.scheduler.update(out)
            eng.counters.count_step(out)
            res = eng.compute.collect(launched)
            eng.scheduler.note_scores(res.block_scores)
            lps = res.logprobs or [None] * len(seqs)
            for seq, tok, lp in zip(seqs, res.token_ids, lps):
                if not seq.is_finished:
                    o = eng.on_token(seq, tok, lp, finished_only)
                    if o is not None:
                        outputs.append(o)
            if eng.controller is not None:
                eng.controller.on_step(out)
            return outputs
        # the commits cover the tokens `prev` sampled, which the cache learns after _finish
        eng.scheduler.update(out, hold=True)
        eng.counters.count_step(out)
        # a length limit is known now: the sequence's last token gets no placeholder
        placeholder = [seq.num_output_tokens + 1 < seq.max_tokens and seq.num_tokens + 1 < eng.max_model_len
                       for seq in seqs]
        eng.plan_ahead({seq.seq_id: 1 for seq, ph in zip(seqs, placeholder) if ph})  # step N+1's plan goes now
        outputs = self._finish(prev, finished_only) if prev is not None else []  # overlaps the device
        eng.scheduler.release_commits()
        if seqs:
            for seq, ph in zip(seqs, placeholder):
                if ph and not seq.is_finished:  # (one that stopped on prev's token runs no more)
                    seq.append_token(PLACEHOLDER)
            self.pending = Pending(seqs, placeholder, launched)
        else:
            eng.scheduler.note_scores(eng.compute.collect(launched).block_scores)
        if eng.controller is not None:  # (a change of the pool or its widths lands the step in flight first)
            eng.controller.on_step(out)
        return outputs
