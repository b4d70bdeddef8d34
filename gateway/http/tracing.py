"""The HTTP server span: each API call is the root of its request's trace (nanokv.tracing).

An ASGI middleware, installed only when tracing is on: it continues a caller's W3C traceparent
header if one came, names the span after the route ("POST /v1/chat/completions") with the HTTP
semantic-convention attributes, and keeps it current while the handler runs, so the engine's
request span (nanokv.gateway.traces) becomes its child. The span ends when the response body has
been sent (a stream's last chunk). Probes and scrapes (/health, /metrics) make no span.
"""

from __future__ import annotations

from typing import Any

from nanokv import tracing

UNTRACED = ("/health", "/metrics")


class TracingMiddleware:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in UNTRACED:
            await self.app(scope, receive, send)
            return
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", [])]
        parent = tracing.extract(headers)
        method, path = scope.get("method", "GET"), scope.get("path", "")
        attrs = {"http.request.method": method, "url.path": path, "url.scheme": scope.get("scheme", "http")}
        status: dict[str, int] = {}

        async def send_traced(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
            await send(message)

        with tracing.span(f"{method} {path}", attrs, kind="SERVER", context=parent) as s:
            await self.app(scope, receive, send_traced)
            if "code" in status:
                s.set_attribute("http.response.status_code", status["code"])
                if status["code"] >= 500:
                    from opentelemetry.trace import Status, StatusCode

                    s.set_status(Status(StatusCode.ERROR))


def install(app: Any) -> None:
    """Add the middleware to a FastAPI app when tracing is on (nothing otherwise)."""
    if tracing.on():
        app.add_middleware(TracingMiddleware)
