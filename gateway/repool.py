"""A pool change through the attach protocol, driven by the gateway (Engine.repool).

The KV pool's layout (block count, per-layer KV width) is fixed when the compute service attaches.
To change it while serving, the gateway
  1. pauses: the pipelined step in flight (async scheduling) is finished and its tokens delivered;
  2. asks the compute service to repool (Compute.Repool): it checks the new layout (a bad one
     changes nothing), drops its sequences and every view of the old segment, calls Cache.Attach
     with the new layout (the cache service allocates it under a new epoch and drops the old
     segment, which nothing maps any more), maps it and captures its CUDA graphs again;
  3. takes every live sequence back as preempted: they wait, in order, to be recomputed on the new
     pool (the old blocks' contents do not move: a width change would need them requantized, and
     recompute is what preemption already does exactly), and the cache service learns them anew;
  4. re-attaches itself (gRPC: the new epoch on every plan and step from then on).
The prefix cache starts empty. No torch here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nanokv.errors import PreconditionError
from nanokv.messages import NewSeq, PlanRequest

if TYPE_CHECKING:
    from nanokv.gateway.engine import Engine


def repool(eng: Engine, num_blocks: int | None = None, layer_bits: list[int] | None = None) -> list[Any]:
    """Change the pool; returns the outputs of the step that was in flight (async scheduling)."""
    if eng.sparsity is not None or (eng.controller is not None and eng.local_cache is not None):
        # (across processes the controller changes the pool through this very function)
        raise PreconditionError("repool", "block sparsity and the in-process adaptive controller hold the pool; "
                                          "they change it themselves")
    outputs: list[Any] = eng._async.land() if eng._async is not None else []  # 1. the step in flight lands
    sch = eng.scheduler
    sch.settle()  # a plan sent ahead is answered before the cache service attaches the new pool
    try:
        info = eng.compute.repool(num_blocks, layer_bits)  # 2. (a bad layout raises here: nothing changed)
    except Exception:
        eng.stashed.extend(outputs)  # the landed step's outputs still go out, with the next step
        raise
    sch.preempt_all()  # 3. running ones back to the front of the queue, oldest first
    sch.news = PlanRequest()  # what the old pool's cache would have learned: it is gone
    eng._finished_ids = []
    for seq in sch.waiting:
        seq.params_sent = False  # the compute service forgot every sequence's sampling params
        sch.news.new_seqs.append(NewSeq(seq.seq_id, list(seq.token_ids), seq.cache_salt))
    eng.num_blocks = info.num_blocks
    eng.model_info = info
    if eng.recovery is not None:  # 4. (gRPC) the new epoch
        eng.recovery.attach()  # (it releases what the cache service held: nothing; the news is not sent yet)
    return outputs
