"""The public gRPC API (nanokv.v1.Generation) of a real `nanokv serve` process, through grpcio.

Answers are checked against the same server's OpenAI HTTP API (greedy: the same tokens whichever
API asks), streaming against the final usage, and every request that ends early against the pool:
all KV blocks back, nothing running, as soon as the call is gone.
"""

from __future__ import annotations

import time
import uuid

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from nanokv.model_files import load_tokenizer
from nanokv.protos import nanokv_v1_pb2 as pb
from tests.helpers_grpc import KEY_A, KEY_B, MAX_WAITING, NUM_BLOCKS, auth, collect, free_blocks_settle

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
LONG = " ".join(f"word{i}" for i in range(60))  # ~4 blocks of 16 tokens: enough for prefix hits


def greedy(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_generate_streams_tokens_like_the_http_api(grpc_server, grpc_stub):
    ids, text, last = collect(grpc_stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=greedy(6)),
                                            metadata=auth(), timeout=60))
    assert len(ids) == 6 and last.finish_reason == "length"
    assert last.usage.completion_tokens == 6 and last.usage.prompt_tokens > 10
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    r = httpx.post(f"{grpc_server.http}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text
    assert r.json()["usage"]["prompt_tokens"] == last.usage.prompt_tokens
    # the same prompt as token ids: the same answer
    prompt_ids = list(load_tokenizer(None)(PROMPT)["input_ids"])
    assert len(prompt_ids) == last.usage.prompt_tokens
    by_ids = collect(grpc_stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids),
                                                           sampling_params=greedy(6)),
                                        metadata=auth(), timeout=60))
    assert by_ids[0] == ids and by_ids[1] == text
    # one chunk per token, each with its logprobs; the last one carries the usage
    chunks = list(grpc_stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=greedy(6, logprobs=2)),
                                metadata=auth(), timeout=60))
    assert [c.token_ids[0] for c in chunks] == ids and all(len(c.token_ids) == 1 for c in chunks)
    assert [c.logprobs[0].token_id for c in chunks] == ids
    assert all(len(c.logprobs[0].top_logprobs) == 2 and c.logprobs[0].logprob <= 0 for c in chunks)
    assert "".join(c.logprobs[0].text for c in chunks) == text
    assert [c.finished for c in chunks] == [False] * 5 + [True] and chunks[-1].usage.completion_tokens == 6


def test_stop_string_and_stop_token(grpc_stub):
    ids, text, _ = collect(grpc_stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=greedy(8)),
                                         metadata=auth(), timeout=60))
    req = pb.GenerateRequest(text=PROMPT, sampling_params=greedy(8, stop_token_ids=[ids[2]]))
    _, _, last = collect(grpc_stub.Generate(req, metadata=auth(), timeout=60))
    assert last.finish_reason == "stop" and last.stop_reason == str(ids[2]) and last.usage.completion_tokens == 3


def test_model_and_server_info(grpc_stub):
    info = grpc_stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=auth(), timeout=10)
    assert info.name == "SmolLM2-135M-Instruct" and info.vocab_size == 49152 and info.block_size == 16
    assert info.max_model_len >= 2048 and len(info.eos_token_ids) >= 1
    s = free_blocks_settle(grpc_stub)
    assert s.kv_blocks_total == NUM_BLOCKS and s.kv_blocks_free == NUM_BLOCKS and s.ready
    assert s.max_waiting == MAX_WAITING and s.version


def test_health_and_reflection_need_no_key(grpc_server):
    with grpc_server.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "nanokv.v1.Generation", "inference.GRPCInferenceService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == 1
        db = ProtoReflectionDescriptorDatabase(ch)  # tells only the public schema
        services = set(db.get_services())
        assert {"nanokv.v1.Generation", "inference.GRPCInferenceService", "grpc.health.v1.Health"} <= services
        gen = db.FindFileContainingSymbol("nanokv.v1.Generation")
        assert gen.package == "nanokv.v1"


def test_tenant_isolation_through_cache_salt(grpc_stub):
    salt = uuid.uuid4().hex  # fresh: no earlier test's blocks can match

    def cached(key: str, cache_salt: str = salt) -> int:
        req = pb.GenerateRequest(text=LONG, sampling_params=greedy(1), cache_salt=cache_salt)
        return collect(grpc_stub.Generate(req, metadata=auth(key), timeout=60))[2].usage.cached_prompt_tokens

    assert cached(KEY_A) == 0
    assert cached(KEY_A) >= 48  # the same tenant and salt: the prompt's full blocks are reused
    assert cached(KEY_B) == 0  # another tenant, the same salt and prompt: nothing shared
    assert cached(KEY_A, salt + "x") == 0  # a salt separates within a tenant too


def test_client_cancel_frees_blocks_at_once(grpc_stub):
    before = free_blocks_settle(grpc_stub)
    call = grpc_stub.Generate(pb.GenerateRequest(text=LONG, sampling_params=greedy(400)), metadata=auth(), timeout=60)
    first = next(call)
    assert len(first.token_ids) == 1
    busy = grpc_stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=auth(), timeout=10)
    assert busy.num_running == 1 and busy.kv_blocks_free < before.kv_blocks_free
    t0 = time.monotonic()
    call.cancel()
    after = free_blocks_settle(grpc_stub)
    assert after.kv_blocks_free == before.kv_blocks_free and after.num_running == 0
    assert time.monotonic() - t0 < 2.0  # at once, not after 400 tokens


def test_deadline_is_honoured_and_frees_blocks(grpc_stub):
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        collect(grpc_stub.Generate(pb.GenerateRequest(text=LONG, sampling_params=greedy(400)), metadata=auth(),
                              timeout=0.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    after = free_blocks_settle(grpc_stub)
    assert after.num_running == 0 and after.kv_blocks_free == after.kv_blocks_total
    assert time.monotonic() - t0 < 5.0


def test_abort_by_id_is_scoped_to_the_caller(grpc_stub):
    rid = f"mine-{uuid.uuid4().hex[:8]}"
    call = grpc_stub.Generate(pb.GenerateRequest(request_id=rid, text=LONG, sampling_params=greedy(400)),
                         metadata=auth(KEY_A), timeout=60)
    assert next(call).request_id == rid
    with pytest.raises(grpc.RpcError) as dup:  # ids are unique among a caller's running requests
        next(grpc_stub.Generate(pb.GenerateRequest(request_id=rid, text="x", sampling_params=greedy(1)),
                           metadata=auth(KEY_A), timeout=10))
    assert dup.value.code() == grpc.StatusCode.ALREADY_EXISTS and "request_id" in dup.value.details()
    assert not grpc_stub.Abort(pb.AbortRequest(request_id=rid), metadata=auth(KEY_B), timeout=5).aborted
    assert grpc_stub.Abort(pb.AbortRequest(request_id=rid), metadata=auth(KEY_A), timeout=5).aborted
    rest = list(call)
    assert rest[-1].finished and rest[-1].finish_reason == "abort" and len(rest) < 100
    assert rest[-1].usage.prompt_tokens > 0
    after = free_blocks_settle(grpc_stub)
    assert after.num_running == 0 and after.kv_blocks_free == after.kv_blocks_total
    assert not grpc_stub.Abort(pb.AbortRequest(request_id=rid), metadata=auth(KEY_A), timeout=5).aborted
