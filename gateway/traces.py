"""The gateway's spans: one per request, one per engine step, linked (nanokv.tracing).

A request span opens at add_request, as a child of whatever is current there (the HTTP handler's
server span, nanokv.gateway.http.tracing), and ends when the request finishes or is aborted; it
carries the OpenTelemetry GenAI attributes (model, token counts, finish reason) and nanokv's own
(prefix-cached tokens, preemptions). A step serves many requests at once, so it is not a child of
any of them: each step is the root of its own small trace, with a span link to every request it
serves, and the cache service's plan and the compute service's forward pass are its children (the
context crosses to them in gRPC metadata). Off, every hook returns after one global test.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from nanokv import tracing

if TYPE_CHECKING:
    from nanokv.gateway.engine import Engine
    from nanokv.gateway.scheduler import SchedulerOutput
    from nanokv.gateway.sequence import Sequence


def start_request(seq: Sequence, model: str, operation: str = "text_completion") -> None:
    """Open `seq`'s request span (stored on seq.trace)."""
    if not tracing.on():
        return
    p = seq.params
    seq.trace = tracing.start_span(f"{operation} {model}", {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": "nanokv",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": seq.max_tokens,
        "gen_ai.request.temperature": float(p.temperature),
        "gen_ai.request.top_p": float(p.top_p),
        "gen_ai.usage.input_tokens": len(seq.prompt_token_ids),
        "nanokv.request_id": seq.request_id,
        "nanokv.seq_id": seq.seq_id,
        "nanokv.tenant_salted": seq.cache_salt is not None,
    }, kind="INTERNAL")


def end_request(seq: Sequence) -> None:
    """Close `seq`'s request span with what it produced (finish reason "abort" when aborted)."""
    s = seq.trace
    if s is None:
        return
    seq.trace = None
    m = seq.metrics
    tracing.set_attributes(s, {
        "gen_ai.response.finish_reasons": [seq.finish_reason or "unknown"],
        "gen_ai.usage.output_tokens": seq.num_output_tokens,
        "nanokv.cached_tokens": seq.num_cached_tokens,
        "gen_ai.usage.cache_read.input_tokens": seq.num_cached_tokens,
        # which tier served the prefix: the lowest one that gave any of it ("none": a full prefill)
        "nanokv.prefix_tier": prefix_tier(seq.num_cached_tokens, seq.cached_tokens_by_tier),
        **{f"nanokv.cached_tokens.{t}": n for t, n in (seq.cached_tokens_by_tier or {}).items()},
        "nanokv.preemptions": seq.num_preemptions,
        "nanokv.ttft_s": (m.first_token_time - m.arrival_time) if m.first_token_time is not None else None,
    })
    s.end()


def prefix_tier(cached: int, by_tier: dict[str, int] | None) -> str:
    if by_tier is None:
        return "L1" if cached else "none"
    served = [t for t, n in sorted(by_tier.items()) if n]
    return served[-1] if served else "none"


def step_span(engine: Engine) -> contextlib.AbstractContextManager[object]:
    """The span of one engine step, current for its plan and compute calls (a root: a new trace)."""
    if not tracing.on():
        return tracing._NULL
    from opentelemetry import context as otel_context

    return tracing.span("nanokv.step", {"gen_ai.request.model": engine.model_name},
                        context=otel_context.Context())


def link_step(out: SchedulerOutput) -> None:
    """Link the current step span to every request the scheduler put in this step."""
    s = tracing.current_span()
    if s is None:
        return
    prefill_tokens = 0
    for sch in out.scheduled:
        rs = sch.seq.trace
        if rs is not None:
            s.add_link(rs.get_span_context(), {"nanokv.num_new_tokens": sch.num_new_tokens})
    for sch in out.prefills:
        prefill_tokens += sch.num_new_tokens
    s.set_attributes({
        "nanokv.batch_size": len(out.scheduled),
        "nanokv.num_prefills": len(out.prefills),
        "nanokv.num_decodes": len(out.scheduled) - len(out.prefills),
        "nanokv.prefill_tokens": prefill_tokens,
        "nanokv.num_tokens": out.num_tokens,
        "nanokv.preempted": len(out.preempted),
    })
