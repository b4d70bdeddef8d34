"""/v1/completions and /v1/chat/completions: start a request, then stream it or collect it.

Every path out of a handler — normal end, client disconnect, cancellation, error — goes through
`AsyncEngine.release`, which aborts an unfinished request so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from nanokv.gateway.http.async_engine import AsyncEngine, EngineUnavailable, QueueFull, RequestStream, Update
from nanokv.gateway.http.errors import OpenAIError, error_body
from nanokv.gateway.http.parsing import parse_body
from nanokv.gateway.http.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from nanokv.gateway.http.translate import (
    ModelInfo,
    chat_inputs,
    chat_logprobs,
    completion_inputs,
    completion_logprobs,
    usage,
)
from nanokv.gateway.outputs import RequestOutput
from nanokv.gateway.sequence import TokenLogprob
from nanokv.sampling import SamplingParams

RETRY_AFTER_S = 1


def cache_salt(request: Request, client_salt: str | None) -> str | None:
    """Tenant (from the API key) and client salt, in separate namespaces so neither can forge the other."""
    tenant = request.scope.get("state", {}).get("tenant")
    parts = ([f"tenant={tenant}"] if tenant else []) + ([f"salt={client_salt}"] if client_salt else [])
    return "|".join(parts) or None


async def start(aengine: AsyncEngine, request_id: str, params: SamplingParams,
                **inputs: Any) -> RequestStream:
    try:
        return await aengine.generate(request_id, params, **inputs)
    except QueueFull as e:
        raise OpenAIError(429, f"server busy: {e}; retry later",
                          headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except EngineUnavailable as e:
        raise OpenAIError(503, str(e)) from None


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(request: Request, stream: RequestStream) -> tuple[Any, dict[int, str]] | None:
    """The final output and all token texts; None if the client disconnected first."""
    texts: dict[int, str] = {}

    async def consume() -> Any:
        last = None
        async for u in stream:
            texts.update(u.token_text)
            last = u.output
        return last

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (consumer, watcher):
            if not task.done():
                task.cancel()
    if not consumer.done() or consumer.cancelled():
        return None
    try:
        return consumer.result(), texts
    except EngineUnavailable as e:
        raise OpenAIError(503, str(e)) from None


def sse_response(aengine: AsyncEngine, stream: RequestStream, chunks: Callable[[Update], list[BaseModel]],
                 final: Callable[[RequestOutput | None], list[BaseModel]]) -> Response:
    async def body() -> AsyncIterator[str]:
        try:
            last: RequestOutput | None = None
            async for u in stream:
                last = u.output
                for c in chunks(u):
                    yield _sse(c)
            for c in final(last):
                yield _sse(c)
            yield "data: [DONE]\n\n"
        except EngineUnavailable as e:
            yield _sse(error_body(503, str(e)))

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return _ReleasingStream(lambda: aengine.release(stream), body(), media_type="text/event-stream",
                            headers=headers)


class _ReleasingStream(StreamingResponse):
    """Releases the request however the response ends. A generator's own `finally` is not enough:
    a client that leaves before the first chunk gets the response cancelled before the generator
    ever starts, and a never-started generator runs no `finally`."""

    def __init__(self, on_close: Callable[[], None], *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _usage(out: RequestOutput) -> Usage:
    return usage(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens, out.cached_tokens_by_tier)


def _new_entries(out: RequestOutput) -> list[TokenLogprob]:
    return out.logprobs[-len(out.new_token_ids):] if out.logprobs and out.new_token_ids else []


async def collect_released(request: Request, aengine: AsyncEngine,
                           stream: RequestStream) -> tuple[Any, dict[int, str]] | None:
    """A non-streaming request's (output, texts), its stream released whatever happens; None when
    the client went away before the end."""
    try:
        return await collect(request, stream)
    finally:
        aengine.release(stream)


async def completions(request: Request, aengine: AsyncEngine, info: ModelInfo) -> Response:
    req = parse_body(await request.body(), CompletionRequest)
    prompt, params = completion_inputs(req, info)
    rid = f"cmpl-{uuid.uuid4().hex}"
    salt = cache_salt(request, req.cache_salt)
    stream = await start(aengine, rid, params, prompt=prompt, cache_salt=salt)
    want_lp = params.logprobs is not None

    if req.stream:
        offset = 0

        def chunks(u: Update) -> list[BaseModel]:
            nonlocal offset
            out = u.output
            lp = completion_logprobs(_new_entries(out), u.token_text, offset) if want_lp else None
            offset += sum(len(t) for t in lp.tokens) if lp else 0
            if not (out.delta_text or out.finished or (lp and lp.tokens)):
                return []
            reason = out.finish_reason if out.finished else None
            choice = CompletionChoice(text=out.delta_text, logprobs=lp, finish_reason=reason)
            return [CompletionResponse(id=rid, model=info.name, choices=[choice])]

        def final(out: RequestOutput | None) -> list[BaseModel]:
            if not (req.stream_options and req.stream_options.include_usage) or out is None:
                return []
            return [CompletionResponse(id=rid, model=info.name, choices=[], usage=_usage(out))]

        return sse_response(aengine, stream, chunks, final)

    result = await collect_released(request, aengine, stream)
    if result is None:
        return Response(status_code=499)  # client closed the request; nobody reads this
    out, texts = result
    lp = completion_logprobs(out.logprobs or [], texts, 0) if want_lp else None
    choice = CompletionChoice(text=out.text, logprobs=lp, finish_reason=out.finish_reason)
    return _json(CompletionResponse(id=rid, model=info.name, choices=[choice], usage=_usage(out)))


async def chat_completions(request: Request, aengine: AsyncEngine, info: ModelInfo) -> Response:
    req = parse_body(await request.body(), ChatCompletionRequest)
    messages, params = chat_inputs(req, info)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    salt = cache_salt(request, req.cache_salt)
    stream = await start(aengine, rid, params, messages=messages, cache_salt=salt)
    want_lp = params.logprobs is not None

    if req.stream:
        first = True

        def chunk(delta: dict[str, str], lp: ChatLogprobs | None = None, reason: str | None = None
                  ) -> ChatCompletionChunk:
            choice = ChatChunkChoice(delta=delta, logprobs=lp, finish_reason=reason)
            return ChatCompletionChunk(id=rid, model=info.name, choices=[choice])

        def chunks(u: Update) -> list[BaseModel]:
            nonlocal first
            out = u.output
            result: list[BaseModel] = []
            if first:  # OpenAI opens every chat stream with the role
                result.append(chunk({"role": "assistant", "content": ""}))
                first = False
            lp = chat_logprobs(_new_entries(out), u.token_text) if want_lp else None
            if out.delta_text or (lp and lp.content):
                result.append(chunk({"content": out.delta_text}, lp))
            if out.finished:
                result.append(chunk({}, reason=out.finish_reason))
            return result

        def final(out: RequestOutput | None) -> list[BaseModel]:
            if not (req.stream_options and req.stream_options.include_usage) or out is None:
                return []
            return [ChatCompletionChunk(id=rid, model=info.name, choices=[], usage=_usage(out))]

        return sse_response(aengine, stream, chunks, final)

    result = await collect_released(request, aengine, stream)
    if result is None:
        return Response(status_code=499)  # client closed the request; nobody reads this
    out, texts = result
    lp = chat_logprobs(out.logprobs or [], texts) if want_lp else None
    message = AssistantMessage(content=out.text)
    choice = ChatChoice(message=message, logprobs=lp, finish_reason=out.finish_reason)
    return _json(ChatCompletionResponse(id=rid, model=info.name, choices=[choice], usage=_usage(out)))
