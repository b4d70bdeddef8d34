"""Trace context over gRPC: the caller's span travels as W3C traceparent metadata.

Client side, intercept_channel wraps a channel so every unary call made while a span is active
carries that span's traceparent (the channel is returned unwrapped when tracing is off: no cost).
Server side, server_interceptors() (used by nanokv.rpc.make_server) opens a SERVER span for each
call that arrived with a traceparent, as the caller's child, and makes it current for the handler,
so spans the service code makes (a plan, a forward pass) land in the caller's trace. Calls without
one (health checks, stats polls) make no span.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import grpc

from nanokv import tracing


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class _ClientDetails(_CallDetails, grpc.ClientCallDetails):
    pass


class TraceContextClientInterceptor(grpc.UnaryUnaryClientInterceptor):
    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        pairs = tracing.inject()
        if pairs:
            md = list(details.metadata or []) + pairs
            details = _ClientDetails(details.method, details.timeout, md, details.credentials,
                                     getattr(details, "wait_for_ready", None), getattr(details, "compression", None))
        return continuation(details, request)


def intercept_channel(ch: grpc.Channel) -> grpc.Channel:
    """`ch`, sending the current trace context with each unary call when tracing is on."""
    if not tracing.on():
        return ch
    return grpc.intercept_channel(ch, TraceContextClientInterceptor())


class TraceContextServerInterceptor(grpc.ServerInterceptor):
    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        parent = tracing.extract(details.invocation_metadata or ())
        if parent is None:
            return handler
        inner = handler.unary_unary
        method = details.method  # "/nanokv.internal.v1.Cache/Plan"
        service, _, name = method.lstrip("/").partition("/")

        def traced(request: Any, context: Any) -> Any:
            attrs = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
            with tracing.span(method.lstrip("/"), attrs, kind="SERVER", context=parent):
                return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(traced, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def server_interceptors() -> list[grpc.ServerInterceptor]:
    """For grpc.server(interceptors=...): none when tracing is off."""
    return [TraceContextServerInterceptor()] if tracing.on() else []
