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

from typing import TYPE_CHECKING

from nanokv.errors import PreconditionError

if TYPE_CHECKING:
    from nanokv.gateway.engine import Engine
    from nanokv.gateway.outputs import RequestOutput


def repool(eng: Engine, num_blocks: int | None = None, layer_bits: list[int] | None = None
           ) -> list[RequestOutput]:
    """Change the pool; returns the outputs of the step that was in flight (async scheduling)."""
    if eng.controller is not None and eng.local_cache is not None:
        # (across processes the controller changes the pool through this very function)
        raise PreconditionError("repool", "the in-process adaptive controller holds the pool; it changes it itself")
    if eng.config.compression_sparsity:  # (the cache service's setting, with the services apart)
        raise PreconditionError("repool", "not with block sparsity (compression_sparsity > 0): its store and "
                                          "decisions are built on the pool at start-up")
    outputs = eng.land()  # 1. the step in flight lands
    sch = eng.scheduler
    sch.settle()  # a plan sent ahead is answered before the cache service attaches the new pool
    try:
        info = eng.compute.repool(num_blocks, layer_bits)  # 2. (a bad layout raises here: nothing changed)
    except Exception:
        eng.stashed.extend(outputs)  # the landed step's outputs still go out, with the next step
        raise
    sch.requeue_all()  # 3. every sequence waits, to be announced to the new pool's cache anew
    eng.pool_changed(info)
    if eng.recovery is not None:  # 4. (gRPC) the new epoch
        eng.recovery.attach()  # (it releases what the cache service held: nothing; the news is not sent yet)
    return outputs
