"""API keys for the gRPC API: `authorization: Bearer KEY` metadata, the same keys and tenants as HTTP.

Health checks need no key (probes carry none), like HTTP's /health; neither does server reflection,
which tells only the public schema (the .proto files ship with nanokv). Every key is compared in
constant time and all of them are tried, so timing reveals neither a key nor which one matched.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from nanokv.gateway.http.middleware import tenant_id

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")
UNAUTHENTICATED_MSG = "missing or invalid API key; send metadata 'authorization: Bearer <key>'"


class KeyRing:
    def __init__(self, api_keys: Sequence[str]):
        self.keys = [k.encode() for k in api_keys]

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def match(self, metadata: Any) -> str | None:
        """The key that `metadata` (pairs of key, value) presents, or None."""
        header = b""
        for k, v in metadata or ():
            if k == "authorization":
                header = v.encode() if isinstance(v, str) else bytes(v)
        scheme, _, token = header.partition(b" ")
        matched = None
        for key in self.keys:
            if hmac.compare_digest(token.strip(), key) and scheme.lower() == b"bearer":
                matched = key
        return matched.decode() if matched is not None else None

    def tenant(self, metadata: Any) -> str | None:
        """The caller's tenant id (None when the server has no keys); it salts the prefix cache."""
        if not self.keys:
            return None
        key = self.match(metadata)
        return tenant_id(key) if key is not None else None


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def abort(_: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MSG)

    async def abort_stream(_: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MSG)
        yield  # an async generator, as a response-streaming handler must be

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream)
    return grpc.unary_unary_rpc_method_handler(abort)


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # (grpc ships no type stubs)
    def __init__(self, keys: KeyRing, on_reject: Callable[[int], None] | None = None):
        self.keys = keys
        self.on_reject = on_reject

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or not self.keys.enabled or method.startswith(OPEN_SERVICES):
            return handler
        if self.keys.match(details.invocation_metadata) is not None:
            return handler
        if self.on_reject is not None:
            self.on_reject(401)
        return _denied(handler)
