"""The two clients of `nanokv bench serve`: a streamed /v1/completions over HTTP (any OpenAI-compatible
server) and a streamed nanokv.v1 Generate over gRPC. Both time the same moments the same way:

- sent: just before the request is written;
- each chunk: when its bytes arrived (the first chunk that carries output is the first token);
- done: when the stream ended.

The HTTP client is plain asyncio (HTTP/1.1, one connection per request, chunked or close-delimited
body, server-sent events), so the benchmark adds no HTTP library to the tools' dependencies and
nothing buffers between the socket and the clock.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import grpc

from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.protos import nanokv_v1_pb2_grpc as pb_grpc


@dataclass
class Record:
    """One request's outcome; times in seconds (sent_s from the run's start, the others from sent_s)."""

    index: int
    prompt_len: int  # token ids sent
    max_tokens: int
    scheduled_s: float = 0.0
    sent_s: float = 0.0
    success: bool = False
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between successive output chunks
    chunks: int = 0  # streamed chunks that carried output
    streamed_tokens: int = -1  # token ids seen in the stream (-1: this API streams text only)
    prompt_tokens: int = 0  # the server's usage, else prompt_len
    output_tokens: int = 0  # the server's usage, else what was streamed
    cached_tokens: int = 0  # prompt tokens the server reported as served from its prefix cache
    finish_reason: str = ""
    conv: int = -1
    turn: int = 0


class HTTPStatusError(Exception):
    pass


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]):
    """Yields the response body's pieces as they arrive (chunked, Content-Length or until close)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            data = await reader.readexactly(size)
            await reader.readline()
            yield data
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            data = await reader.read(min(left, 65536))
            if not data:
                return
            left -= len(data)
            yield data
    else:
        while data := await reader.read(65536):
            yield data


async def post_sse(url: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float):
    """POST `body` as JSON; yields (arrival time, data) per server-sent event."""
    u = urlsplit(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(
        u.hostname, port, ssl=ssl.create_default_context() if u.scheme == "https" else None), timeout_s)
    try:
        payload = json.dumps(body).encode()
        head = [f"POST {u.path or '/'} HTTP/1.1", f"Host: {u.netloc}", "Content-Type: application/json",
                f"Content-Length: {len(payload)}", "Accept: text/event-stream", "Connection: close"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        status = (await asyncio.wait_for(reader.readline(), timeout_s)).decode("latin-1").split()
        resp: dict[str, str] = {}
        while (line := (await reader.readline()).decode("latin-1").strip()):
            k, _, v = line.partition(":")
            resp[k.strip().lower()] = v.strip()
        if len(status) < 2 or status[1] != "200":
            text = b"".join([p async for p in _read_body(reader, resp)]).decode(errors="replace")
            raise HTTPStatusError(f"HTTP {status[1] if len(status) > 1 else '?'}: {text[:300]}")
        buf = b""
        async for piece in _read_body(reader, resp):
            now = time.perf_counter()
            buf += piece.replace(b"\r\n", b"\n")
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
                if data:
                    yield now, b"\n".join(data).decode()
    finally:
        writer.close()


def _chunk_times(rec: Record, t_sent: float, times: list[float], t_done: float) -> None:
    if times:
        rec.ttft_s = times[0] - t_sent
        rec.itl_s = [b - a for a, b in zip(times, times[1:])]
    rec.chunks = len(times)
    rec.e2e_s = t_done - t_sent


async def openai_request(rec: Record, prompt: list[int], *, url: str, model: str, api_key: str | None,
                         temperature: float, ignore_eos: bool, timeout_s: float, t0: float) -> list[int]:
    """Fills `rec` from one streamed /v1/completions; returns the output token ids it knows (none:
    the OpenAI stream carries text only)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": rec.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": temperature}
    if ignore_eos:
        body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    times: list[float] = []
    state: dict[str, Any] = {"usage": None, "done": False}

    async def consume() -> None:
        async for t, data in post_sse(url, body, headers, timeout_s):
            if data == "[DONE]":
                state["done"] = True
                return
            event = json.loads(data)
            if "error" in event:
                raise HTTPStatusError(f"stream error: {event['error']}")
            for choice in event.get("choices") or []:
                # a chunk per token; its text may be empty (held back mid-character, or a model
                # without a tokenizer: random weights), it is a token arrival all the same
                times.append(t)
                rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
            state["usage"] = event.get("usage") or state["usage"]

    t_sent = time.perf_counter()
    rec.sent_s = t_sent - t0
    try:
        await asyncio.wait_for(consume(), timeout_s)
    except (OSError, asyncio.TimeoutError, HTTPStatusError, ValueError, asyncio.IncompleteReadError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:400]
        return []
    usage, done = state["usage"], state["done"]
    _chunk_times(rec, t_sent, times, time.perf_counter())
    rec.prompt_tokens = int((usage or {}).get("prompt_tokens", rec.prompt_len))
    rec.output_tokens = int((usage or {}).get("completion_tokens", len(times)))
    rec.cached_tokens = int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    rec.success = done and bool(times or rec.output_tokens == 0)
    if not rec.success:
        rec.error = rec.error or "the stream ended without [DONE]"
    return []


async def grpc_request(rec: Record, prompt: list[int], *, stub: pb_grpc.GenerationStub, api_key: str | None,
                       temperature: float, ignore_eos: bool, timeout_s: float, t0: float) -> list[int]:
    """Fills `rec` from one streamed nanokv.v1 Generate; returns the output token ids."""
    params = pb.SamplingParams(max_tokens=rec.max_tokens, temperature=temperature, ignore_eos=ignore_eos)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling_params=params)
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    times: list[float] = []
    ids: list[int] = []
    last = None
    t_sent = time.perf_counter()
    rec.sent_s = t_sent - t0
    try:
        async for chunk in stub.Generate(request, metadata=metadata, timeout=timeout_s):
            t = time.perf_counter()
            if chunk.token_ids:
                times.append(t)
                ids.extend(chunk.token_ids)
            last = chunk
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        rec.error = f"grpc {code.name if code else '?'}: {e.details() if hasattr(e, 'details') else e}"[:400]
        return []
    _chunk_times(rec, t_sent, times, time.perf_counter())
    rec.streamed_tokens = len(ids)
    if last is None or not last.finished:
        rec.error = "the stream ended before its finished chunk"
        return ids
    rec.prompt_tokens, rec.output_tokens = last.usage.prompt_tokens, last.usage.completion_tokens
    rec.cached_tokens = last.usage.cached_prompt_tokens
    rec.finish_reason = last.finish_reason
    rec.success = last.finish_reason != "abort"
    if not rec.success:
        rec.error = "aborted by the server"
    return ids
