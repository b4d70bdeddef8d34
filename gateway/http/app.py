"""The OpenAI-compatible FastAPI app around one Engine.

    app = build_app(Engine(config), api_key="secret")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: /v1/models, /v1/completions, /v1/chat/completions (SSE when stream=true), /ready, /health (no
auth, for probes), /metrics (Prometheus text format).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from nanokv import tracing
from nanokv.gateway.http.async_engine import AsyncEngine
from nanokv.gateway.http.defaults import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING
from nanokv.gateway.http.errors import install_error_handlers
from nanokv.gateway.http.generate import chat_completions, completions
from nanokv.gateway.http.middleware import AuthMiddleware, BodyLimitMiddleware
from nanokv.gateway.http.schemas import ModelCard, ModelList
from nanokv.gateway.http.tracing import install as install_tracing
from nanokv.gateway.http.translate import ModelInfo
from nanokv.gateway.metrics import CONTENT_TYPE, EngineMetrics

if TYPE_CHECKING:
    import grpc

    from nanokv.gateway.engine import Engine


def build_app(
    engine: Engine,
    *,
    api_key: str | Sequence[str] | None = None,
    max_waiting: int = DEFAULT_MAX_WAITING,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    served_model_name: str | None = None,
    metrics: EngineMetrics | None = None,
    grpc_address: str | None = None,
    grpc_credentials: grpc.ServerCredentials | None = None,
) -> FastAPI:
    """Build the app. `api_key`: one key or several (one per tenant; each gets its own prefix cache).

    The engine thread starts with the app (lifespan) and stops with it, aborting what is in flight.
    Several apps may be built over one engine over time, but only one may run at a time.
    `grpc_address` ("HOST:PORT"): also serve the public gRPC API there, on this app's event loop;
    over TLS with `grpc_credentials` (nanokv.tls.ServerTLS.grpc_credentials).
    """
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if any(not k for k in keys):
        raise ValueError("api_key: keys must be non-empty strings")
    if max_waiting < 0:
        raise ValueError(f"max_waiting: got {max_waiting}; must be >= 0")
    if max_body_bytes < 1024:
        raise ValueError(f"max_body_bytes: got {max_body_bytes}; must be at least 1024")
    metrics = metrics if metrics is not None else EngineMetrics()
    aengine = AsyncEngine(engine, metrics, max_waiting=max_waiting)
    # Read once here, before the engine thread exists: afterwards only that thread touches the engine.
    info = ModelInfo(
        name=served_model_name or engine.model_name,
        max_model_len=int(engine.max_model_len),
    )

    grpc_api = None
    if grpc_address:
        from nanokv.gateway.grpc_api import GrpcApi

        grpc_api = GrpcApi(engine, aengine, address=grpc_address, model_name=info.name, api_keys=keys,
                           max_message_bytes=max_body_bytes, on_reject=metrics.observe_rejection,
                           credentials=grpc_credentials)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await aengine.start()
        try:
            if grpc_api is not None:
                await grpc_api.start()
            yield
        finally:
            if grpc_api is not None:
                await grpc_api.stop()
            await aengine.stop()
            tracing.flush()  # uvicorn re-raises SIGTERM after this: no atexit would export the last spans

    app = FastAPI(title="nanokv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.async_engine = aengine
    app.state.metrics = metrics
    app.state.model_info = info
    app.state.grpc_api = grpc_api
    install_error_handlers(app, metrics.observe_rejection)
    # Starlette runs the last-added middleware first: auth, then the body limit, then routing.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, on_error=metrics.observe_rejection)
    app.add_middleware(AuthMiddleware, api_keys=keys, on_error=metrics.observe_rejection)
    install_tracing(app)  # outermost: a rejected call is traced too (no-op unless OTEL_* turn tracing on)

    @app.get("/health")
    async def health() -> Response:
        if aengine.healthy:
            return JSONResponse({"status": "ok"})
        reason = f"engine failed: {aengine.error!r}" if aengine.error else "engine not running"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @app.get("/ready")
    async def ready() -> Response:
        # readiness, not liveness: false while a service the gateway needs is down (it re-attaches)
        if aengine.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "reason": aengine.not_ready_reason}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        await aengine.refresh_stats()
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=info.name, max_model_len=info.max_model_len)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def v1_completions(request: Request) -> Response:
        return await completions(request, aengine, info)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(request: Request) -> Response:
        return await chat_completions(request, aengine, info)

    return app
