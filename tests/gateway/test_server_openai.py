"""The OpenAI-compatible server, through the official `openai` client, against a real uvicorn
server on 127.0.0.1 running the real engine (embedded SmolLM2-135M, CPU, fp32)."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from nanokv.gateway.http import build_app
from nanokv.gateway.http.testing import serve_in_thread, shared_engine

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
# long enough to fill a couple of 16-token blocks, so a repeat can hit the prefix cache
LONG = ("You are a careful assistant. Answer briefly and precisely. The user is asking about the "
        "history of the printing press in Europe and its effect on literacy.")


@pytest.fixture(scope="module")
def server():
    app = build_app(shared_engine(), api_key=[KEY_A, KEY_B], max_waiting=64, max_body_bytes=64 * 1024)
    with serve_in_thread(app) as url:
        yield app, url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY_A, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def used_blocks(app) -> int:
    return app.state.async_engine.submit_call(lambda e: e.cache_manager.num_used_blocks()).result(60)


def test_models(client, model):
    assert model == "SmolLM2-135M-Instruct"


def test_completion_and_stream_agree(client, model, server):
    salt = uuid.uuid4().hex  # fresh salt: no prefix hits, so both runs compute the same numbers
    kw = dict(model=model, prompt="The capital of France is", max_tokens=6, temperature=0,
              extra_body={"cache_salt": salt})
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 6 and full.usage.prompt_tokens > 0
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6
    assert used_blocks(server[0]) == 0


def test_chat_and_stream_agree(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    kw = dict(model=model, messages=messages, max_tokens=6, temperature=0,
              extra_body={"cache_salt": uuid.uuid4().hex})
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert full.object == "chat.completion" and full.usage.total_tokens == full.usage.prompt_tokens + 6
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_repeated_prompt_reports_cached_tokens(client, model):
    prompt = f"{uuid.uuid4().hex} {LONG}"
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_tenants_never_share_cached_blocks(server, model):
    url = server[1] + "/v1"
    a = openai.OpenAI(base_url=url, api_key=KEY_A, max_retries=0)
    b = openai.OpenAI(base_url=url, api_key=KEY_B, max_retries=0)
    messages = [{"role": "user", "content": f"{uuid.uuid4().hex} {LONG}"}]

    def cached(c: openai.OpenAI, **extra) -> int:
        r = c.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body=extra or None)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(a) == 0
    assert cached(a) > 0  # same tenant: the prefix is reused
    assert cached(b) == 0  # other tenant, same prompt: nothing shared
    assert cached(a, cache_salt="s1") == 0  # a request salt isolates within a tenant too
    assert cached(a, cache_salt="s1") > 0
    assert cached(b, cache_salt="s1") == 0  # the same salt string under another key is still separate


def test_logprobs(client, model):
    r = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count: 1, 2,"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].bytes == list(content[0].token.encode())


def test_stop_and_seed(client, model):
    salt = uuid.uuid4().hex
    kw = dict(model=model, prompt="Once upon a time", max_tokens=12, extra_body={"cache_salt": salt})
    full = client.completions.create(temperature=0, **kw).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = client.completions.create(temperature=0, stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]
    s1 = client.completions.create(temperature=1.0, seed=1234, **kw).choices[0].text
    s2 = client.completions.create(temperature=1.0, seed=1234, **kw).choices[0].text
    assert s1 == s2


def test_sdk_errors(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi")
    assert e.value.body["code"] == "model_not_found"
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---- a catalogue of bad requests: each gets the right 4xx, names the field, server keeps serving --

M = "SmolLM2-135M-Instruct"
MSG = [{"role": "user", "content": "hi"}]
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
BAD = [  # (id, path, json body or raw bytes, status, param)
    ("malformed-json", CMPL, b'{"model": "x", "prompt": ', 400, None),
    ("json-array", CMPL, b"[1, 2]", 400, None),
    ("invalid-utf8", CMPL, b'{"model": "\xff\xfe", "prompt": "hi"}', 400, None),
    ("nan-literal", CMPL, b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % M.encode(), 400, None),
    ("oversize-body", CMPL, {"model": M, "prompt": "x" * 100_000}, 413, None),
    ("missing-model", CMPL, {"prompt": "hi"}, 400, "model"),
    ("unknown-model", CMPL, {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("missing-prompt", CMPL, {"model": M}, 400, "prompt"),
    ("prompt-wrong-type", CMPL, {"model": M, "prompt": 5}, 400, "prompt"),
    ("prompt-negative-id", CMPL, {"model": M, "prompt": [1, -2]}, 400, "prompt"),
    ("prompt-id-out-of-vocab", CMPL, {"model": M, "prompt": [1, 10**9]}, 400, "prompt"),
    ("prompt-empty", CMPL, {"model": M, "prompt": ""}, 400, "prompt"),
    ("prompt-batch", CMPL, {"model": M, "prompt": ["a", "b"]}, 400, "prompt"),
    ("max-tokens-string", CMPL, {"model": M, "prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ("max-tokens-bool", CMPL, {"model": M, "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("max-tokens-negative", CMPL, {"model": M, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("max-tokens-huge", CMPL, {"model": M, "prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),
    ("never-fits-kv-cache", CMPL, {"model": M, "prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ("temperature-negative", CMPL, {"model": M, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("temperature-string", CMPL, {"model": M, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("top-p-zero", CMPL, {"model": M, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top-k-negative", CMPL, {"model": M, "prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("n-2", CMPL, {"model": M, "prompt": "hi", "n": 2}, 400, "n"),
    ("logprobs-too-many", CMPL, {"model": M, "prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("stop-wrong-type", CMPL, {"model": M, "prompt": "hi", "stop": 123}, 400, "stop"),
    ("seed-negative", CMPL, {"model": M, "prompt": "hi", "seed": -1}, 400, "seed"),
    ("unknown-field", CMPL, {"model": M, "prompt": "hi", "max_token": 3}, 400, "max_token"),
    ("penalty-unsupported", CMPL, {"model": M, "prompt": "hi", "presence_penalty": 1.0}, 400,
     "presence_penalty"),
    ("echo-unsupported", CMPL, {"model": M, "prompt": "hi", "echo": True}, 400, "echo"),
    ("stream-options-no-stream", CMPL, {"model": M, "prompt": "hi", "stream_options": {}}, 400,
     "stream_options"),
    ("cache-salt-empty", CMPL, {"model": M, "prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    ("chat-empty-messages", CHAT, {"model": M, "messages": []}, 400, "messages"),
    ("chat-messages-not-list", CHAT, {"model": M, "messages": "hi"}, 400, "messages"),
    ("chat-unknown-role", CHAT, {"model": M, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages[0].role"),
    ("chat-missing-content", CHAT, {"model": M, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("chat-image-part", CHAT, {"model": M, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     400, "messages[0].content"),
    ("chat-empty-user", CHAT, {"model": M, "messages": [{"role": "user", "content": " "}]}, 400,
     "messages[0].content"),
    ("chat-top-logprobs-alone", CHAT, {"model": M, "messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat-n-3", CHAT, {"model": M, "messages": MSG, "n": 3}, 400, "n"),
]


@pytest.mark.parametrize("path,body,status,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request(server, path, body, status, param):
    headers = {"Authorization": f"Bearer {KEY_A}"}
    if isinstance(body, bytes):
        headers["Content-Type"] = "application/json"
        r = httpx.post(server[1] + path, content=body, headers=headers)
    else:
        r = httpx.post(server[1] + path, json=body, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert len(err["message"]) > 10
    if param is not None:
        assert err["message"].startswith(param.split(".")[0].split("[")[0]), err["message"]


@pytest.mark.parametrize("headers,status", [
    ({}, 401), ({"Authorization": "Bearer nope"}, 401), ({"Authorization": f"Basic {KEY_A}"}, 401),
])
def test_auth_required(server, headers, status):
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(server[1] + path, headers=headers)
        assert r.status_code == status and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server[1] + "/health").json() == {"status": "ok"}  # probes need no key


def test_wrong_method_and_route(server):
    h = {"Authorization": f"Bearer {KEY_A}"}
    assert httpx.get(server[1] + CMPL, headers=h).status_code == 405
    r = httpx.get(server[1] + "/v1/nothing", headers=h)
    assert r.status_code == 404 and "error" in r.json()


def test_still_serving_after_bad_requests(client, model, server):
    r = client.completions.create(model=model, prompt="Hello", max_tokens=2)
    assert r.choices[0].text and r.usage.completion_tokens == 2
    assert used_blocks(server[0]) == 0
    text = httpx.get(server[1] + "/metrics", headers={"Authorization": f"Bearer {KEY_B}"}).text
    assert 'nanokv_requests_rejected_total{status="400"}' in text
    assert "nanokv_time_to_first_token_seconds_count" in text
    assert "nanokv_kv_cache_usage_ratio 0.0" in text
