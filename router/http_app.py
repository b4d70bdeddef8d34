"""The router's OpenAI HTTP front: the same routes as a gateway's (gateway/http/app.py), each request
forwarded to the replica the router picks, its body unchanged and its response streamed back.

A replica that refuses the connection is reported down and the next one is tried (nothing was sent
to it). A stream that breaks mid-way (the replica died) ends with an error event, as a gateway's own
stream does when its engine goes away; a stream whose replica is marked down by the health checks is
closed the same way, so no client waits on a silent socket."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nanokv.gateway.http.errors import error_body
from nanokv.gateway.http.middleware import AuthMiddleware
from nanokv.router.metrics import CONTENT_TYPE
from nanokv.router.service import NoReplica, ReplicaDown, RouterService, until_down

log = logging.getLogger("nanokv.router.http")
FORWARD_HEADERS = ("authorization", "content-type", "traceparent", "tracestate", "accept")
MAX_TRIES = 3


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status)


def _sse_error(status: int, message: str) -> bytes:
    return f"data: {json.dumps(error_body(status, message))}\n\n".encode()


def _presented_key(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def build_router_app(svc: RouterService) -> Starlette:
    tls = svc.pool.tls
    # https to the replicas: their CA (or the system's), the router's client certificate if any; a set
    # server name is what their certificates are checked against (SNI) instead of the address dialled
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=httpx.Limits(max_connections=None),
                               verify=tls.ssl_context() if tls is not None else True)
    ext = {"sni_hostname": tls.server_name} if tls is not None and tls.server_name else None

    async def generate(request: Request, api: str) -> Response:
        raw = await request.body()
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = None
        ids = None
        if svc.router.policy == "kv":  # (round-robin reads no prompt)
            await svc.ensure_tokenizer()
            ids = svc.prompts.chat(body) if api == "chat" else svc.prompts.completion(body)
        salt = body.get("cache_salt") if isinstance(body, dict) else None
        try:
            choice = svc.choose(api, ids, svc.tenant(_presented_key(request)),
                                salt if isinstance(salt, str) else None)
        except NoReplica as e:
            return _error(503, str(e))
        headers = {k: v for k, v in request.headers.items() if k in FORWARD_HEADERS}
        for rep in choice.order[:MAX_TRIES]:
            upstream = client.build_request("POST", rep.http_base + request.url.path, content=raw,
                                            headers=headers, extensions=ext)
            try:
                with svc.holding(rep):  # counted from now: a non-streaming reply's headers come at its end
                    resp = await client.send(upstream, stream=True)
            except httpx.TransportError as e:
                log.warning("replica %s: %s", rep.name, e)
                svc.failed(rep)
                continue
            return await _relay(svc, rep, resp)
        return _error(503, "no replica could be reached")

    async def _relay(svc: RouterService, rep: Any, resp: httpx.Response) -> Response:
        streaming = resp.headers.get("content-type", "").startswith("text/event-stream")
        out_headers = {k: v for k, v in resp.headers.items()
                       if k in ("content-type", "retry-after", "cache-control", "x-request-id")}
        if not streaming:  # whole, so a replica that dies half-way gives a clean 503, not a cut body
            try:
                with svc.holding(rep):
                    data = b"".join([c async for c in until_down(resp.aiter_raw(), rep)])
            except (httpx.HTTPError, ReplicaDown) as e:
                svc.failed(rep)
                return _error(503, f"replica {rep.name} failed during the request: {type(e).__name__}")
            finally:
                await resp.aclose()
            return Response(data, resp.status_code, headers=out_headers)

        async def body() -> AsyncIterator[bytes]:
            with svc.holding(rep):
                try:
                    async for chunk in until_down(resp.aiter_raw(), rep):
                        yield chunk
                except (httpx.HTTPError, ReplicaDown) as e:
                    svc.failed(rep)
                    yield _sse_error(503, f"replica {rep.name} failed during the request: {type(e).__name__}")
                finally:
                    await resp.aclose()

        return StreamingResponse(body(), status_code=resp.status_code, headers=out_headers)

    async def completions(request: Request) -> Response:
        return await generate(request, "completions")

    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k in FORWARD_HEADERS}
        for rep in svc.pool.healthy()[:MAX_TRIES]:
            try:
                r = await client.get(rep.http_base + "/v1/models", headers=headers, timeout=10, extensions=ext)
            except httpx.TransportError:
                svc.failed(rep)
                continue
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        return _error(503, svc.no_replica_reason())

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "healthy_replicas": len(svc.pool.healthy())})

    async def ready(request: Request) -> Response:
        n = len(svc.pool.healthy())
        if n:
            return JSONResponse({"status": "ready", "healthy_replicas": n})
        # (an open path: the replicas' addresses and check errors go only to authenticated callers)
        return JSONResponse({"status": "not ready", "reason": "no healthy replica"}, status_code=503)

    async def metrics(request: Request) -> Response:
        return Response(svc.metrics.render(), media_type=CONTENT_TYPE)

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/models", models), Route("/health", health), Route("/ready", ready),
              Route("/metrics", metrics)]
    app = Starlette(routes=routes)
    app.add_middleware(AuthMiddleware, api_keys=svc.api_keys)
    app.state.client = client
    return app
