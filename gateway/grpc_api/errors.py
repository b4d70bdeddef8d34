"""Every failure of the public gRPC API becomes a status code here, in one function.

`status_for` is the only place that decides codes, so new error kinds (an unavailable service, a
tracing hook) are added in one line. Messages name the field and the allowed values; internals
(stack traces, engine state) go to the log, not to the client.
"""

from __future__ import annotations

import logging

import grpc

from nanokv.errors import NanoKVError, PreconditionError, ServiceUnavailable
from nanokv.gateway.http.streams import EngineUnavailable, QueueFull

log = logging.getLogger("nanokv.gateway.grpc")

RETRY_AFTER_S = 1  # what a client told RESOURCE_EXHAUSTED should wait before trying again

Metadata = tuple[tuple[str, str], ...]


class ModelNotFound(Exception):
    """The request names a model this server does not serve."""


class DuplicateRequest(Exception):
    """The caller already has a running request with this id."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, Metadata]:
    """(code, details, trailing metadata) for an exception raised while serving a call."""
    if isinstance(exc, PreconditionError):  # an internal call a restarted peer refused (StaleEpoch): an outage
        return grpc.StatusCode.UNAVAILABLE, f"a service is unavailable: {exc}", ()
    if isinstance(exc, NanoKVError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), ()
    if isinstance(exc, ModelNotFound):
        return grpc.StatusCode.NOT_FOUND, str(exc), ()
    if isinstance(exc, DuplicateRequest):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc), ()
    if isinstance(exc, QueueFull):
        # grpc-retry-pushback-ms is what gRPC's own retry policy reads; retry-after mirrors HTTP 429
        advice = (("retry-after", str(RETRY_AFTER_S)), ("grpc-retry-pushback-ms", str(RETRY_AFTER_S * 1000)))
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {exc}; retry after {RETRY_AFTER_S} s", advice
    if isinstance(exc, (EngineUnavailable, ServiceUnavailable)):  # the engine, or a service it needs, is down
        return grpc.StatusCode.UNAVAILABLE, str(exc), ()
    log.error("unhandled error in a gRPC handler", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see server log", ()


def stream_error_message(exc: BaseException) -> str:
    """The text of a per-request error inside a KServe stream (the stream itself goes on)."""
    code, details, _ = status_for(exc)
    return f"{code.name}: {details}"
