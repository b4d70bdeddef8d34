"""The public gRPC server: nanokv.v1.Generation, KServe v2, grpc.health.v1 and reflection.

It is a grpc.aio server on the gateway's own event loop (started and stopped by the HTTP app's
lifespan), so it drives the same AsyncEngine as the OpenAI routes: one scheduler, one admission
queue, one prefix cache for both APIs.

Handlers are registered with raw-bytes deserializers and parse requests themselves
(validate.parse): a malformed message then answers INVALID_ARGUMENT naming the message instead of
gRPC's INTERNAL "Exception deserializing request".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from nanokv.gateway.grpc_api import readiness
from nanokv.gateway.grpc_api.auth import AuthInterceptor, KeyRing
from nanokv.gateway.grpc_api.errors import status_for
from nanokv.gateway.grpc_api.generation import GenerationServicer, PublicModelInfo
from nanokv.gateway.grpc_api.kserve import KServeServicer
from nanokv.gateway.grpc_api.kv_events import KvEventsRelay
from nanokv.gateway.grpc_api.validate import parse
from nanokv.gateway.http.async_engine import AsyncEngine
from nanokv.protos import kv_events_pb2
from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.protos.kserve import grpc_service_pb2 as ks

if TYPE_CHECKING:
    from nanokv.gateway.engine import Engine

log = logging.getLogger("nanokv.gateway.grpc")

GENERATION = pb.DESCRIPTOR.services_by_name["Generation"]
KSERVE = ks.DESCRIPTOR.services_by_name["GRPCInferenceService"]
KV_EVENTS = kv_events_pb2.DESCRIPTOR.services_by_name["KvEvents"]  # for a router (router/)


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code, details, trailers = status_for(exc)
    if trailers:
        context.set_trailing_metadata(trailers)
    await context.abort(code, details)


def _handler(method: Any, impl: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """One method: parse bytes -> message, run impl, map any error to a status (errors.status_for)."""
    from google.protobuf import symbol_database

    db = symbol_database.Default()
    req_cls = db.GetSymbol(method.input_type.full_name)
    serialize = db.GetSymbol(method.output_type.full_name).SerializeToString

    if method.client_streaming:
        async def parsed(requests: AsyncIterator[bytes]) -> AsyncIterator[Any]:
            async for data in requests:
                try:
                    yield parse(data, req_cls)
                except Exception as exc:  # handed on: the servicer answers this request with an error
                    yield exc

        async def bidi(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in impl(parsed(requests), context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort(context, exc)

        return grpc.stream_stream_rpc_method_handler(bidi, response_serializer=serialize)

    if method.server_streaming:
        async def streaming(data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in impl(parse(data, req_cls), context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort(context, exc)

        return grpc.unary_stream_rpc_method_handler(streaming, response_serializer=serialize)

    async def unary(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await impl(parse(data, req_cls), context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc)

    return grpc.unary_unary_rpc_method_handler(unary, response_serializer=serialize)


def _service(descriptor: Any, servicer: Any) -> grpc.GenericRpcHandler:
    handlers = {m.name: _handler(m, getattr(servicer, m.name)) for m in descriptor.methods}
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)


class GrpcApi:
    """Built with the HTTP app (reading the engine before its thread starts); started in its lifespan."""

    def __init__(self, engine: Engine, aengine: AsyncEngine, *, address: str, model_name: str,
                 api_keys: Sequence[str] = (), max_message_bytes: int = 4 << 20,
                 on_reject: Callable[[int], None] | None = None,
                 credentials: grpc.ServerCredentials | None = None):
        self.address = address
        self.credentials = credentials  # TLS (nanokv.tls); None: plaintext
        self.keys = KeyRing(api_keys)
        self.max_message_bytes = max_message_bytes
        self.on_reject = on_reject
        self.aengine = aengine
        self.generation = GenerationServicer(aengine, PublicModelInfo.from_engine(engine, model_name), self.keys)
        self.kserve = KServeServicer(self.generation, self.keys)
        self.kv_events = KvEventsRelay(engine)
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        options = [("grpc.max_receive_message_length", self.max_message_bytes),
                   ("grpc.max_send_message_length", 64 << 20),
                   ("grpc.so_reuseport", 0)]
        server = grpc.aio.server(interceptors=[AuthInterceptor(self.keys, self.on_reject)], options=options)
        server.add_generic_rpc_handlers((_service(GENERATION, self.generation), _service(KSERVE, self.kserve),
                                         _service(KV_EVENTS, self.kv_events)))
        hs = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        names = (GENERATION.full_name, KSERVE.full_name, KV_EVENTS.full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        if self.credentials is not None:
            self.port = server.add_secure_port(self.address, self.credentials)
        else:
            self.port = server.add_insecure_port(self.address)
        if self.port == 0 and not self.address.startswith("unix:"):
            raise OSError(f"gRPC API: cannot listen on {self.address}")
        await server.start()
        # "" is liveness (/health), the two API services readiness (/ready): gateway/grpc_api/readiness.py
        served = (GENERATION.full_name, KSERVE.full_name)
        await readiness.publish(hs, self.aengine, served)
        self._health_task = asyncio.create_task(readiness.mirror(hs, self.aengine, served))
        self.server, self.health = server, hs
        log.info("gRPC API (nanokv.v1, KServe v2) on %s%s", self.address, " (TLS)" if self.credentials else "")

    async def stop(self, grace_s: float = 2.0) -> None:
        if self.server is not None:
            self._health_task.cancel()
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace_s)
            self.server = None
