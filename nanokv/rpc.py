"""What every nanokv gRPC server and client shares (no torch): addresses, options, health, errors.

Addresses are gRPC's: "unix:/path/to.sock" (or unix:///path) and "HOST:PORT"; servers bind
loopback unless told otherwise. Each server also serves grpc.health.v1 (the overall status "" and
its service's name), SERVING once it can take work.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from nanokv.errors import NanoKVError, PreconditionError, ServiceUnavailable, StaleEpoch

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20  # internal links only: a long prompt's tokens, a large step
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),  # notice a dead peer within seconds, not at the next call
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # a restarted peer is reconnected within a second, not after gRPC's default backoff (up to 120 s)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
# max_ping_strikes 0: never answer a peer's keepalive pings with GOAWAY "too_many_pings". On a loaded
# host two pings can be read back to back; the default (2 strikes) then closed long-lived streams
# (the compute service's health watch on the cache service) every minute or so under load.
SERVER_OPTIONS = CHANNEL_OPTIONS + [("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
                                    ("grpc.http2.max_ping_strikes", 0)]


def is_loopback_address(address: str) -> bool:
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def make_server(address: str, max_workers: int = 16) -> tuple[grpc.Server, health.HealthServicer]:
    from nanokv.trace_grpc import server_interceptors  # traceparent in the metadata: the caller's trace

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=SERVER_OPTIONS,
                         interceptors=server_interceptors())
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    if not is_loopback_address(address):
        log.warning("internal service listening on %s: only the gateway's port is meant to be exposed", address)
    if server.add_insecure_port(address) == 0 and not address.startswith("unix:"):
        raise OSError(f"cannot listen on {address}")
    return server, hs


def set_serving(hs: health.HealthServicer, names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *names]:
        hs.set(name, status)


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def wait_serving(address: str, timeout_s: float, service: str = "") -> None:
    """Block until `address` answers grpc.health.v1 Check with SERVING (start-up ordering)."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as e:
                last = e
            time.sleep(0.1)
    raise TimeoutError(f"{address} not serving after {timeout_s:.0f} s ({last})")


def status_of(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, PreconditionError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, (NanoKVError, ValueError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, (FileNotFoundError, LookupError)):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


@contextmanager
def rpc_errors(context: grpc.ServicerContext, failed_precondition: tuple[type[BaseException], ...] = ()
               ) -> Iterator[None]:
    """Turn an exception in a handler into a gRPC status with its message (never a crash)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every failure becomes a status for the caller
        code = grpc.StatusCode.FAILED_PRECONDITION if isinstance(e, failed_precondition) else status_of(e)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("internal error in a handler")
        context.abort(code, f"{type(e).__name__}: {e}")


def remote_error(e: grpc.RpcError, what: str) -> Exception:
    """A client-side error for a failed internal call: NanoKVError for the caller's bad input,
    PreconditionError (StaleEpoch: a peer restarted) for a call that no longer fits the peer's
    state, ServiceUnavailable for everything else (peer gone, deadline passed, peer's own fault)."""
    code: Any = e.code() if hasattr(e, "code") else None
    detail = e.details() if hasattr(e, "details") else str(e)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return NanoKVError(what, detail or "invalid argument")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        if (detail or "").startswith("StaleEpoch"):
            return StaleEpoch(0, 0, f"{what}: {detail}")
        return PreconditionError(what, detail or "failed precondition")
    return ServiceUnavailable(f"{what}: {code.name if code is not None else 'error'}: {detail}")


def add_servicer(server: grpc.Server, servicer: Any, service: str, pb: Any) -> None:
    """Register `servicer` for `service` ("Cache" / "Compute" of the generated module `pb`,
    protos/internal.proto's; the caller passes it, so this layer never imports protos/) so that no
    request can crash it: requests arrive as bytes and a body that does not parse is answered with
    INVALID_ARGUMENT (gRPC's own deserializer would answer INTERNAL), and any exception a handler
    lets escape becomes INTERNAL with its message, never a dropped call."""
    desc = pb.DESCRIPTOR.services_by_name[service]
    handlers = {}
    for m in desc.methods:
        req_cls, reply_cls = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
        handlers[m.name] = grpc.unary_unary_rpc_method_handler(
            _guarded(getattr(servicer, m.name), req_cls, f"{service}.{m.name}"),
            request_deserializer=None, response_serializer=reply_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(desc.full_name, handlers),))


def _guarded(method: Callable[..., Any], req_cls: Any, name: str) -> Callable[[bytes, Any], Any]:
    from google.protobuf.message import DecodeError

    def handler(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            request = req_cls.FromString(raw)
        except (DecodeError, ValueError, TypeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: malformed request ({e})")
        try:
            return method(request, context)
        except Exception as e:  # noqa: BLE001 - a handler's own abort passes; anything else is a status
            if context.code() is not None:
                raise
            log.exception("unexpected error in %s", name)
            context.abort(status_of(e), f"{type(e).__name__}: {e}")
    return handler


def call(fn: Callable[..., Any], request: Any, timeout: float, what: str) -> Any:
    try:
        return fn(request, timeout=timeout)
    except grpc.RpcError as e:
        raise remote_error(e, what) from None


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set `stop` (a service's main loop waits on it); main thread only.

    Only the first signal acts. A handler runs on the main thread between bytecodes, so a second
    signal (a parent's SIGTERM and the parent-death SIGTERM arrive together) can land while the first
    handler is inside stop.set(), holding the event's lock: set() again there would wait on that lock
    forever, and the service would never exit."""
    if threading.current_thread() is not threading.main_thread():
        return
    fired: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if fired:
            return
        fired.append(signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
