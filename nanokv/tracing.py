"""OpenTelemetry tracing, configured from the standard OTEL_* environment variables.

Tracing is on in a process when OTEL_TRACES_EXPORTER names an exporter ("otlp", "console") or an
OTLP endpoint is set (OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), unless
OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none. The SDK reads the rest itself: the endpoint,
OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_* (batching), OTEL_RESOURCE_ATTRIBUTES. OTEL_SERVICE_NAME
names the process; without it each service calls itself nanokv-gateway / -cache / -compute.

The decision is taken once, at the first hook, and opentelemetry is imported only when it is on,
so the services run without the packages installed. Off, a hook is one call and a global test.
Context crosses process boundaries as W3C traceparent in gRPC metadata (nanokv.trace_grpc).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

_ON: bool | None = None  # None: not decided yet
_TRACER: Any = None
_PROVIDER: Any = None
_ROLE = "gateway"
_NULL = contextlib.nullcontext()

TRACER_NAME = "nanokv"


def set_role(role: str) -> None:
    """The process's part (gateway, cache, compute): its service.name unless OTEL_SERVICE_NAME is set.
    Call before the first hook."""
    global _ROLE
    _ROLE = role


def _wanted(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    if exporters:
        return exporters != ["none"]
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def on() -> bool:
    """Whether spans are made in this process (decided once, from the environment)."""
    if _ON is None:
        _setup(os.environ)
    return bool(_ON)


def _setup(env: Mapping[str, str]) -> None:
    global _ON
    if not _wanted(env):
        _ON = False
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as e:
        raise RuntimeError("tracing is configured (OTEL_* variables) but opentelemetry-sdk is not installed: "
                           "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc") from e
    name = env.get("OTEL_SERVICE_NAME") or f"nanokv-{_ROLE}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    names = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if e.strip()]
    for exporter in names or ["otlp"]:
        if exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif exporter == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif exporter != "none":
            raise ValueError(f"OTEL_TRACES_EXPORTER: {exporter!r}; allowed: otlp, console, none")
    use_provider(provider)


def use_provider(provider: Any) -> None:
    """Trace through `provider` (an SDK TracerProvider; tests pass one with an in-memory exporter),
    or turn tracing off with None."""
    global _ON, _TRACER, _PROVIDER
    _PROVIDER = provider
    _TRACER = provider.get_tracer(TRACER_NAME) if provider is not None else None
    _ON = provider is not None


def flush(timeout_ms: int = 5000) -> None:
    """Export what is buffered now (before a process exits without running atexit)."""
    if _PROVIDER is not None:
        _PROVIDER.force_flush(timeout_ms)


def tracer() -> Any:
    return _TRACER


def span(name: str, attributes: Mapping[str, Any] | None = None, *, kind: str = "INTERNAL",
         context: Any = None) -> contextlib.AbstractContextManager:
    """A span made current for the `with` body (a shared null context when tracing is off)."""
    if not (_ON if _ON is not None else on()):
        return _NULL
    from opentelemetry.trace import SpanKind

    return _TRACER.start_as_current_span(name, context=context, kind=getattr(SpanKind, kind),
                                         attributes=dict(attributes or {}))


def start_span(name: str, attributes: Mapping[str, Any] | None = None, *, kind: str = "INTERNAL") -> Any:
    """A span that outlives the caller's frame (end it with end_span); None when tracing is off."""
    if not (_ON if _ON is not None else on()):
        return None
    from opentelemetry.trace import SpanKind

    return _TRACER.start_span(name, kind=getattr(SpanKind, kind), attributes=dict(attributes or {}))


def current_span() -> Any:
    """The active recording span, or None (also when tracing is off)."""
    if not (_ON if _ON is not None else on()):
        return None
    from opentelemetry import trace

    s = trace.get_current_span()
    return s if s.is_recording() else None


def set_attributes(span_: Any, attributes: Mapping[str, Any]) -> None:
    if span_ is not None:
        span_.set_attributes({k: v for k, v in attributes.items() if v is not None})


# ---- W3C trace context in carriers (gRPC metadata, HTTP headers) -------------------------------------
def inject() -> list[tuple[str, str]]:
    """The current context as ("traceparent", ...) pairs; [] when off or no span is active."""
    if not (_ON if _ON is not None else on()):
        return []
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return list(carrier.items())


def extract(pairs: Sequence[tuple[str, Any]]) -> Any:
    """A parent context from carrier pairs holding a traceparent, else None."""
    carrier = {str(k).lower(): v for k, v in pairs if str(k).lower() in ("traceparent", "tracestate")}
    if "traceparent" not in carrier or not on():
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({k: (v.decode() if isinstance(v, bytes) else str(v))
                                                    for k, v in carrier.items()})


@contextlib.contextmanager
def attached(ctx: Any) -> Iterator[None]:
    """Make `ctx` (from capture(), extract()) current for the body; no-op for None."""
    if ctx is None:
        yield
        return
    from opentelemetry import context as otel_context

    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def capture() -> Any:
    """The current context, to carry to another thread (None when off)."""
    if not (_ON if _ON is not None else on()):
        return None
    from opentelemetry import context as otel_context

    return otel_context.get_current()
