"""The compute service's view of a scheduled step: the StepRequest built from the scheduler's output
(rows prefills first, each row's input tokens, the rows that sample, and what changed since the last
step). No torch here.
"""

from __future__ import annotations

import time

from nanokv.gateway import traces
from nanokv.gateway.scheduler import SchedulerOutput
from nanokv.messages import StepRequest


def build_step_request(out: SchedulerOutput, step_id: int, finished: list[int]) -> StepRequest:
    """`finished`: the sequences ended since the last step, for the compute service to forget.
    Marks each new sequence's parameters sent and stamps its first-scheduled time."""
    sched = out.scheduled
    traces.link_step(out)
    req = StepRequest(step_id, num_prefills=len(out.prefills), tables=out.tables,
                      preempted=[s.seq_id for s in out.preempted])
    now = time.monotonic()
    tokens = req.tokens
    for r, s in enumerate(sched):
        seq = s.seq
        start, n = seq.num_computed_tokens, s.num_new_tokens
        req.seq_ids.append(seq.seq_id)
        req.num_computed.append(start)
        req.num_new.append(n)
        if n == 1:
            tokens.append(seq.token_ids[start])
        else:
            tokens.extend(seq.token_ids[start:start + n])
        if start + n == seq.num_tokens:
            req.sample_rows.append(r)
        if not seq.params_sent:
            req.new_seqs.append((seq.seq_id, seq.params))
            seq.params_sent = True
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = now
    req.finished = finished
    return req
