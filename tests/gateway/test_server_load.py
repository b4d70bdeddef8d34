"""Server under load (real engine, real uvicorn): admission control and client disconnects.

200 concurrent streaming clients: each either streams to a complete answer or is turned away with
429 + Retry-After, nothing else. 100 clients that vanish mid-stream: their requests are aborted and
every KV block comes back. The engine is read only through the app's engine-thread hook.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from nanokv.gateway.http import build_app
from nanokv.gateway.http.testing import serve_in_thread, shared_engine

KEY = "load-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_WAITING = 48


@pytest.fixture(scope="module")
def server():
    app = build_app(shared_engine(), api_key=KEY, max_waiting=MAX_WAITING)
    with serve_in_thread(app) as url:
        yield app, url


def engine_state(app) -> tuple[bool, int]:
    fn = lambda e: (e.has_unfinished_requests(), e.cache_manager.num_used_blocks())  # noqa: E731
    return app.state.async_engine.submit_call(fn).result(60)


def wait_until_idle(app, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy, used = engine_state(app)
        if not busy and used == 0 and app.state.async_engine.num_in_flight == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"engine not idle after {timeout_s}s: (busy, used blocks) = {engine_state(app)}")


def aborts(url: str) -> float:
    text = httpx.get(url + "/metrics", headers=AUTH).text
    found = re.search(r'^nanokv_requests_finished_total\{finish_reason="abort"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def async_client(url: str) -> openai.AsyncOpenAI:
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(180.0))
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, http_client=http)


def test_200_concurrent_streams_complete_or_429(server):
    app, url = server

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        try:
            stream = await client.completions.create(
                model="SmolLM2-135M-Instruct", prompt=f"Request {i}: count to ten.", max_tokens=4,
                temperature=0, stream=True, extra_body={"ignore_eos": True},
            )
            texts, reasons = [], []
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
                reasons.append(chunk.choices[0].finish_reason)
            assert reasons[-1] == "length" and all(r is None for r in reasons[:-1]), reasons
            return "ok"
        except openai.RateLimitError as e:
            assert e.response.headers.get("retry-after") == "1"
            assert e.body["code"] == "rate_limit_exceeded"
            return "429"

    async def main() -> list[str]:
        client = async_client(url)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(200)), return_exceptions=True)

    results = asyncio.run(main())
    errors = [r for r in results if not isinstance(r, str)]
    assert not errors, errors[:3]
    ok = results.count("ok")
    assert ok + results.count("429") == 200
    assert ok >= MAX_WAITING, f"only {ok} completed"  # at least a full waiting queue was served
    wait_until_idle(app)
    metrics = httpx.get(url + "/metrics", headers=AUTH).text
    assert "nanokv_kv_cache_usage_ratio 0.0" in metrics
    assert "nanokv_num_requests_running 0.0" in metrics


def test_100_disconnects_free_every_block(server):
    app, url = server
    got_first = 0
    before = aborts(url)

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        nonlocal got_first
        try:
            stream = await client.completions.create(
                model="SmolLM2-135M-Instruct", prompt=f"Story {i}: once upon a time", max_tokens=1000,
                stream=True, extra_body={"ignore_eos": True},
            )
        except openai.RateLimitError:
            return "429"
        async with stream:  # leaving the block closes the connection mid-stream
            async for _ in stream:
                got_first += 1
                break
        return "left"

    async def main() -> list[str]:
        client = async_client(url)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(100)), return_exceptions=True)

    results = asyncio.run(main())
    assert all(r in ("left", "429") for r in results), [r for r in results if r not in ("left", "429")][:3]
    assert results.count("left") == got_first >= 32
    # 1000-token requests would keep the engine busy for minutes; idle within seconds means aborted
    wait_until_idle(app, timeout_s=15)
    assert aborts(url) - before == got_first  # every vanished client's request was aborted
    # and the server still serves
    r = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0).completions.create(
        model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2)
    assert r.usage.completion_tokens == 2
    wait_until_idle(app)


def test_abandoned_non_streaming_request_is_aborted(server):
    app, url = server
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Tell a long story.", "max_tokens": 1000,
            "ignore_eos": True}
    aborted = aborts(url)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=1.0)
    wait_until_idle(app, timeout_s=10)  # 1000 tokens take far longer than this on CPU
    assert aborts(url) == aborted + 1
