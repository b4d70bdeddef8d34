"""The router's gRPC front: nanokv.v1.Generation and KServe v2 forwarded as raw bytes to a replica's
public gRPC server (the same methods, so every client and status code stays as a gateway's), plus
grpc.health.v1. Generate and ModelInfer are read to route them by their prompt; Abort goes where the
request it names runs; the rest go to any healthy replica.

A replica that cannot be reached before any reply is reported down and the next is tried; a stream
that breaks mid-way, or whose replica is marked down by the checks, ends with UNAVAILABLE."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from nanokv.gateway.grpc_api.auth import AuthInterceptor, KeyRing
from nanokv.gateway.grpc_api.kserve import to_generate_request
from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.protos.kserve import grpc_service_pb2 as ks
from nanokv.router.replica import Replica
from nanokv.router.service import NoReplica, ReplicaDown, RouterService, until_down

log = logging.getLogger("nanokv.router.grpc")
GENERATION = pb.DESCRIPTOR.services_by_name["Generation"]
KSERVE = ks.DESCRIPTOR.services_by_name["GRPCInferenceService"]
FORWARD_METADATA = ("authorization", "traceparent", "tracestate")
MAX_TRIES = 3


def _metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, v in context.invocation_metadata() or () if k in FORWARD_METADATA)


def _key(metadata: tuple[tuple[str, str], ...]) -> str | None:
    for k, v in metadata:
        if k == "authorization":
            scheme, _, token = v.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


async def _pass_on(context: grpc.aio.ServicerContext, e: grpc.aio.AioRpcError) -> None:
    trailers = tuple((k, v) for k, v in e.trailing_metadata() or () if not k.startswith("grpc-"))
    if trailers:
        context.set_trailing_metadata(trailers)
    await context.abort(e.code(), e.details() or "")


class GrpcProxy:
    def __init__(self, svc: RouterService):
        self.svc = svc
        self.running: dict[tuple[str | None, str], Replica] = {}  # (tenant, request id) -> where, for Abort

    # ---- where a call goes ------------------------------------------------------------------------------
    def _route(self, method: str, data: bytes | None, md: tuple[tuple[str, str], ...]
               ) -> tuple[list[Replica], str | None, str]:
        """(replicas best first, tenant, request id)."""
        tenant = self.svc.tenant(_key(md))
        ids, salt, rid = None, None, ""
        try:
            if self.svc.router.policy != "kv":  # (round-robin reads no prompt)
                req = None
            elif method == "Generate" and data is not None:
                req = pb.GenerateRequest.FromString(data)
            elif method == "ModelInfer" and data is not None:
                m = ks.ModelInferRequest.FromString(data)
                req = to_generate_request(m, m.model_name)
            else:
                req = None
            if req is not None:
                rid, salt = req.request_id, req.cache_salt
                which = req.WhichOneof("input")
                ids = list(req.token_ids.ids) if which == "token_ids" else self.svc.prompts.text(req.text)
            elif method == "Abort" and data is not None:
                where = self.running.get((tenant, pb.AbortRequest.FromString(data).request_id))
                if where is not None and where.healthy:
                    return [where], tenant, ""
        except Exception:  # unreadable: the replica answers the error
            ids = None
        if method in ("Generate", "ModelInfer", "ModelStreamInfer"):
            return self.svc.choose(method, ids, tenant, salt).order, tenant, rid
        return sorted(self.svc.pool.healthy(), key=lambda r: r.inflight), tenant, rid

    # ---- the three shapes of call -----------------------------------------------------------------------
    def unary(self, path: str, method: str) -> Callable[..., Any]:
        async def handle(data: bytes, context: grpc.aio.ServicerContext) -> bytes:
            md = _metadata(context)
            if method in ("Generate", "ModelInfer"):
                await self.svc.ensure_tokenizer()
            try:
                order, _, _ = self._route(method, data, md)
            except NoReplica as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            for rep in order[:MAX_TRIES]:
                try:
                    with self.svc.holding(rep):
                        out: bytes = await rep.channel.unary_unary(path)(
                            data, metadata=md, timeout=context.time_remaining())
                    return out
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        await _pass_on(context, e)
                    self.svc.failed(rep)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no replica could be reached")
            raise AssertionError("unreachable")  # (abort raises)

        return handle

    def server_stream(self, path: str, method: str) -> Callable[..., Any]:
        async def handle(data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            md = _metadata(context)
            await self.svc.ensure_tokenizer()
            try:
                order, tenant, rid = self._route(method, data, md)
            except NoReplica as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            for rep in order[:MAX_TRIES]:
                call = rep.channel.unary_stream(path)(data, metadata=md, timeout=context.time_remaining())
                got = False
                if rid:
                    self.running[(tenant, rid)] = rep
                try:
                    with self.svc.holding(rep):
                        async for msg in until_down(call, rep):
                            got = True
                            yield msg
                    return
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        await _pass_on(context, e)
                    self.svc.failed(rep)
                    if got:
                        await context.abort(grpc.StatusCode.UNAVAILABLE,
                                            f"replica {rep.name} failed during the request: {e.details()}")
                except ReplicaDown as e:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
                finally:
                    call.cancel()
                    if rid and self.running.get((tenant, rid)) is rep:
                        del self.running[(tenant, rid)]
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no replica could be reached")

        return handle

    def bidi(self, path: str, method: str) -> Callable[..., Any]:
        async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            md = _metadata(context)
            try:
                order, _, _ = self._route(method, None, md)
            except NoReplica as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            rep = order[0]
            call = rep.channel.stream_stream(path)(requests, metadata=md, timeout=context.time_remaining())
            try:
                with self.svc.holding(rep):
                    async for msg in until_down(call, rep):
                        yield msg
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self.svc.failed(rep)
                await _pass_on(context, e)
            except ReplicaDown as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            finally:
                call.cancel()

        return handle

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        out = []
        for desc in (GENERATION, KSERVE):
            methods = {}
            for m in desc.methods:
                path = f"/{desc.full_name}/{m.name}"
                if m.client_streaming:
                    methods[m.name] = grpc.stream_stream_rpc_method_handler(self.bidi(path, m.name))
                elif m.server_streaming:
                    methods[m.name] = grpc.unary_stream_rpc_method_handler(self.server_stream(path, m.name))
                else:
                    methods[m.name] = grpc.unary_unary_rpc_method_handler(self.unary(path, m.name))
            out.append(grpc.method_handlers_generic_handler(desc.full_name, methods))
        return out


async def start_grpc(svc: RouterService, address: str, credentials: grpc.ServerCredentials | None = None
                     ) -> tuple[grpc.aio.Server, int]:
    """The front on `address`; over TLS with `credentials` (nanokv.tls.ServerTLS.grpc_credentials)."""
    server = grpc.aio.server(interceptors=[AuthInterceptor(KeyRing(svc.api_keys))],
                             options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    server.add_generic_rpc_handlers(tuple(GrpcProxy(svc).handlers()))
    hs = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    if credentials is not None:
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"router gRPC: cannot listen on {address}")
    await server.start()
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    await hs.set("", serving)  # liveness: the router runs; readiness per API: a replica is up

    def ready(up: bool) -> None:
        for name in (GENERATION.full_name, KSERVE.full_name):
            asyncio.ensure_future(hs.set(name, serving if up else not_serving))

    svc.on_health.append(ready)
    ready(bool(svc.pool.healthy()))
    return server, port
