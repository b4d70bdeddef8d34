"""ASGI middleware: API-key auth and the request-body size limit.

Both run before FastAPI routing, so they protect every route (unknown ones too) and reject before
a byte of an oversize or unauthenticated body is parsed.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanokv.gateway.http.errors import OpenAIError, error_response

OPEN_PATHS = frozenset({"/health", "/ready"})  # liveness and readiness probes carry no credentials


def tenant_id(api_key: str) -> str:
    """A stable, non-reversible id for a key; it salts the prefix cache so tenants never share blocks."""
    return hashlib.sha256(b"nanokv-tenant:" + api_key.encode()).hexdigest()[:24]


class AuthMiddleware:
    """Bearer-token check; stores the caller's tenant id in scope['state']['tenant']."""

    def __init__(self, app: ASGIApp, api_keys: list[str], on_error: Callable[[int], None] | None = None):
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or not self.keys:
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        matched = None
        # compare against every key (no early exit) so timing reveals neither a key nor which one
        for key in self.keys:
            if hmac.compare_digest(token.strip(), key) and scheme.lower() == b"bearer":
                matched = key
        if matched is None:
            if self.on_error is not None:
                self.on_error(401)
            msg = "missing or invalid API key; send 'Authorization: Bearer <key>'"
            err = OpenAIError(401, msg, headers={"WWW-Authenticate": "Bearer"})
            await error_response(err)(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant_id(matched.decode())
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Buffers the body up to `max_bytes` (413 past it), then replays it to the app.

    Buffering is fine: valid requests are small JSON documents. After the replay, `receive` goes
    to the server again so handlers still see `http.disconnect` when a client leaves.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, on_error: Callable[[int], None] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)  # disconnect: let the app see it
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.on_error is not None:
            self.on_error(413)
        msg = f"request body is larger than the limit of {self.max_bytes} bytes"
        await error_response(OpenAIError(413, msg))(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
