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
Steps whose requests want logprobs sample synchronously (the logprob tensors are read at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanokv.gateway.sequence import Sequence

if TYPE_CHECKING:
    from nanokv.gateway.engine import Engine, RequestOutput

PLACEHOLDER = -1


@dataclass
class Pending:
    """A launched step whose sampled tokens the host has not read yet."""
    seqs: list[Sequence]
    placeholder: list[bool]  # row got a placeholder token (else: its last, it finishes by length)
    tokens: torch.Tensor  # [n] int64 on the device: feeds the next step's inputs
    host: torch.Tensor  # [n] int64 host copy (pinned on CUDA), valid once `event` completes
    event: torch.cuda.Event | None
    row_of: dict[int, int]  # seq_id -> row


class AsyncStepper:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.pending: Pending | None = None
        self._pinned: list[torch.Tensor] = []  # two alternating pinned buffers (step N and N+1)
        self._flip = 0

    def _to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if not tokens.is_cuda:
            return tokens, None
        n = tokens.shape[0]
        if not self._pinned or self._pinned[0].shape[0] < n:
            size = max(n, self.engine.config.max_num_seqs)
            self._pinned = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._flip ^= 1
        host = self._pinned[self._flip][:n]
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    @staticmethod
    def _feed(prev: Pending, sched) -> tuple[torch.Tensor, list[int], list[int]]:
        """Input slots of this step that hold a placeholder of `prev`: (tokens, src rows, dst offsets)."""
        src: list[int] = []
        dst: list[int] = []
        end = 0
        for s in sched:
            end += s.num_new_tokens
            seq = s.seq
            row = prev.row_of.get(seq.seq_id)
            if (row is not None and prev.placeholder[row] and seq.token_ids[-1] == PLACEHOLDER
                    and seq.num_computed_tokens + s.num_new_tokens == seq.num_tokens):
                src.append(row)
                dst.append(end - 1)
        return prev.tokens, src, dst

    def _finish(self, prev: Pending, finished_only: bool) -> list[RequestOutput]:
        """Read `prev`'s tokens (its copy is complete or nearly) and run the usual per-token logic."""
        eng = self.engine
        if prev.event is not None:
            prev.event.synchronize()
        outputs = []
        for seq, ph, tok in zip(prev.seqs, prev.placeholder, prev.host.tolist()):
            if seq.is_finished:
                continue  # aborted, or stopped: this was the token one too many
            o = eng._on_token(seq, tok, None, finished_only, replace=ph)
            if o is not None:
                outputs.append(o)
        return outputs

    def step(self, finished_only: bool) -> list[RequestOutput]:
        eng = self.engine
        out = eng.scheduler.schedule()
        prev, self.pending = self.pending, None
        if out.is_empty:
            return self._finish(prev, finished_only) if prev is not None else []
        sched = out.scheduled
        items, rows = eng._step_items(out)
        feed = self._feed(prev, sched) if prev is not None else None
        logits = eng.runner.execute(items, rows, feed=feed)
        seqs = [sched[r].seq for r in rows]
        params = [s.params for s in seqs]
        sync = any(p.logprobs is not None for p in params)
        tokens = host = event = None
        if rows and not sync:
            assert logits is not None  # rows to sample always get logits
            tokens = eng.sampler.sample(logits, params, [s.seq_id for s in seqs])
            host, event = self._to_host(tokens)
        outputs = self._finish(prev, finished_only) if prev is not None else []  # overlaps the device
        eng.scheduler.update(out)
        eng._count_step(out)
        if rows and sync:
            assert logits is not None
            res = eng.sampler(logits, params, [s.seq_id for s in seqs])
            for seq, tok, lp in zip(seqs, res.token_ids, res.logprobs):
                if not seq.is_finished:
                    o = eng._on_token(seq, tok, lp, finished_only)
                    if o is not None:
                        outputs.append(o)
        elif tokens is not None and host is not None:
            placeholder = []
            for seq in seqs:
                # a length limit is known now: the sequence's last token gets no placeholder
                ph = (not seq.is_finished and seq.num_output_tokens + 1 < seq.max_tokens
                      and seq.num_tokens + 1 < eng.max_model_len)
                if ph:
                    seq.append_token(PLACEHOLDER)
                placeholder.append(ph)
            self.pending = Pending(seqs, placeholder, tokens, host, event,
                                   {s.seq_id: r for r, s in enumerate(seqs)})
        return outputs
