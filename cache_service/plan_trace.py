"""The cache service's span for one plan (nanokv.tracing): what the step cost the block pool.

A plan is a child of the gateway's step span (in process directly, across processes through the
gRPC metadata). Its attributes are the plan's deltas on the cache manager's counters: prefix
lookups (tokens queried, tokens hit), blocks allocated fresh, blocks evicted to make room,
blocks published to the prefix cache, preemptions; one "prefix lookup" event per admitted
sequence with its hit. Off, plan() pays one global test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from nanokv import tracing
from nanokv.kv.formats import kv_format
from nanokv.messages import PlanReply, PlanRequest

if TYPE_CHECKING:
    from nanokv.cache_service.service import CacheService

_COUNTERS = ("prefix_queries_tokens", "prefix_hits_tokens", "blocks_allocated", "evictions", "blocks_cached",
             "preemptions", "recomputed_tokens")


@contextlib.contextmanager
def plan_span(svc: CacheService, request: PlanRequest) -> Iterator[_Reply | None]:
    """Around CacheService.plan; the body hands its reply to the yielded holder's `reply`."""
    if not tracing.on() or svc.manager is None:
        yield None
        return
    cm = svc.manager
    before = {k: getattr(cm.stats, k) for k in _COUNTERS}
    holder = _Reply()
    layout = svc.storage.layout if svc.storage is not None else None
    attrs: dict[str, str | int | bool] = {
        "nanokv.eviction_policy": cm.policy_name,
        "nanokv.new_seqs": len(request.new_seqs),
        "nanokv.finished_seqs": len(request.finished),
        "nanokv.running_seqs": len(request.running),
        "nanokv.waiting_candidates": len(request.waiting),
        "nanokv.news_only": request.is_news_only,
    }
    if layout is not None:
        attrs["nanokv.kv_format"] = kv_format(layout.layer_bits, layout.dtype)
    with tracing.span("nanokv.cache.plan", attrs) as s:
        yield holder
        after = {k: getattr(cm.stats, k) for k in _COUNTERS}
        reply: PlanReply | None = holder.reply
        out = {f"nanokv.{k}": after[k] - before[k] for k in _COUNTERS}
        out["nanokv.blocks_evicted"] = out.pop("nanokv.evictions")
        out["nanokv.blocks_free"] = cm.num_free_blocks()
        out["nanokv.blocks_cached_total"] = cm.num_cached_blocks()
        if reply is not None:
            out["nanokv.admitted"] = len(reply.admitted)
            out["nanokv.cached_tokens"] = sum(hit for _, hit, _ in reply.admitted)
            for seq_id, hit, new in reply.admitted:
                s.add_event("prefix lookup", {"nanokv.seq_id": seq_id, "nanokv.cached_tokens": hit,
                                              "nanokv.new_tokens": new})
        s.set_attributes(out)


class _Reply:
    reply: PlanReply | None = None
