"""An OTLP/gRPC trace receiver in the calling process (opentelemetry-proto's TraceService): the
services export to it as they would to a collector; spans come back as plain dicts."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request: Any, context: Any) -> Any:
        got = []
        for rs in request.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append({
                        "service": res.get("service.name"), "name": s.name, "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex() or None,
                        "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                        "attributes": {a.key: _value(a.value) for a in s.attributes},
                        "links": [(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                        "events": [e.name for e in s.events],
                    })
        with self.lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, pred: Any, timeout_s: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = list(self.spans)
            if pred(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.2)

    def stop(self) -> None:
        self.server.stop(0)
