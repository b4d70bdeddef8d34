"""A service's own Prometheus endpoint: the cache and compute services' health, scraped directly.

The gateway's /metrics (gateway/metrics.py) reports the engine as a whole, reading the services'
counters over RPC; it cannot say that a service is slow, failing or gone. Each service therefore
serves, on prometheus_client's own HTTP server (127.0.0.1:<metrics_port> by default, off when the
port is 0), what only it knows:
- process metrics (process_*, python_gc_*, python_info): memory, CPU, open files;
- nanokv_rpc_server_handled_total{service, method, code}: RPCs answered, by gRPC status code;
- nanokv_rpc_server_handling_seconds{service, method, code}: how long the servicer took;
- gauges the service adds (the cache service: its pool's occupancy, nanokv_cache_pool_*).
None of these names is exported by the gateway, so a board that sums the gateway's series never
counts a service's twice (OWN_PREFIXES lists the families this module's endpoints own).

Calls are counted inside the servicer: a body that does not parse is answered by nanokv.rpc before
the servicer sees it, and health checks are grpc.health.v1's own; neither is counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

from nanokv.rpc import status_of

log = logging.getLogger(__name__)

# the metric families only the services' own endpoints export (never the gateway's /metrics)
OWN_PREFIXES = ("nanokv_rpc_server_", "nanokv_cache_pool_")
# a plan is ~0.1 ms, a CPU forward step up to seconds, a model load-sized Attach longer
_RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0, 30.0, 60.0)


class ServiceMetrics:
    """One service's registry (no global state: two in one process never share series)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.handled = Counter("nanokv_rpc_server_handled", "RPCs answered by this service, by gRPC status code.",
                               ["service", "method", "code"], registry=r)
        self.latency = Histogram("nanokv_rpc_server_handling_seconds", "Time from a request's arrival in the "
                                 "servicer to its answer.", ["service", "method", "code"], buckets=_RPC_BUCKETS,
                                 registry=r)
        self._server: Any = None

    def gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A gauge read at scrape time (`read` must be cheap and thread-safe)."""
        Gauge(name, doc, registry=self.registry).set_function(read)

    def instrument(self, servicer: Any, service: Any) -> Any:
        """`servicer` with each RPC method of `service` (the generated service descriptor, e.g.
        internal_pb2.DESCRIPTOR.services_by_name["Cache"]) counted and timed; give the result to
        nanokv.rpc.add_servicer in the servicer's place."""
        return _Instrumented(servicer, self, service.full_name, [m.name for m in service.methods])

    def observe(self, service: str, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.handled.labels(service, method, code.name).inc()
        self.latency.labels(service, method, code.name).observe(seconds)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Serve /metrics on host:port (0: do nothing). A port already taken is an error: an operator
        who asked for metrics should not find a service silently without them."""
        if not port:
            return
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(f"metrics_port: cannot serve /metrics on {host}:{port} ({e})") from e
        log.info("metrics on http://%s:%d/metrics", host, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Instrumented:
    """Proxy of a servicer: the RPC methods are wrapped, every other attribute is the servicer's."""

    def __init__(self, servicer: Any, metrics: ServiceMetrics, service: str, methods: Iterable[str]):
        self._servicer = servicer
        for name in methods:
            setattr(self, name, _timed(getattr(servicer, name), metrics, service, name))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._servicer, name)


def _timed(method: Callable[[Any, Any], Any], metrics: ServiceMetrics, service: str, name: str
           ) -> Callable[[Any, Any], Any]:
    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        t0 = time.perf_counter()
        try:
            reply = method(request, context)
        except Exception as e:
            # an abort set the code; anything else becomes status_of(e) in nanokv.rpc's guard
            metrics.observe(service, name, context.code() or status_of(e), time.perf_counter() - t0)
            raise
        metrics.observe(service, name, context.code() or grpc.StatusCode.OK, time.perf_counter() - t0)
        return reply
    handler.__name__ = name
    return handler
