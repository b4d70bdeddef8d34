"""Load on the public gRPC API: 200 concurrent streaming clients (grpc.aio, one process) against a real
CPU `nanokv serve`, then 100 clients that cancel after their first chunk.

The first two tests use the shared test server (tests/helpers_grpc.py): 32 running sequences at
most (--max-num-seqs) and 48 waiting (--max-waiting), so 200 at once must overflow admission and
RESOURCE_EXHAUSTED is reached. The last one repeats the 200 streams on `nanokv serve` with the
default configuration (256 running, 256 waiting: every stream is admitted).

What must hold: every call completes with the greedy answer or gets
RESOURCE_EXHAUSTED with retry advice, no other status; afterwards every KV block is free and
nothing runs or waits; cancelled calls leave nothing behind and the server answers the next
request exactly as before.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc
import pytest

from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.protos import nanokv_v1_pb2_grpc as pb_grpc
from tests.helpers_grpc import auth, collect, free_blocks_settle, start_server

CLIENTS, CANCELLERS, CHANNELS = 200, 100, 4
PROMPTS = [f"Item {i}: the quick brown fox jumps over the lazy dog number" for i in range(8)]


def request(i: int, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=PROMPTS[i % len(PROMPTS)],
                              sampling_params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0))


@pytest.fixture(scope="module")
def alone(grpc_stub):
    """Each prompt's greedy 4-token answer with nothing else running."""
    return [collect(grpc_stub.Generate(request(i, 4), metadata=auth(), timeout=60))[0] for i in range(len(PROMPTS))]


async def many(address: str, n: int, client) -> list:
    channels = [grpc.aio.insecure_channel(address) for _ in range(CHANNELS)]
    try:
        stubs = [pb_grpc.GenerationStub(ch) for ch in channels]
        return await asyncio.gather(*(client(stubs[i % CHANNELS], i) for i in range(n)))
    finally:
        for ch in channels:
            await ch.close()


async def complete(stub: pb_grpc.GenerationStub, i: int) -> tuple[str, object]:
    call = stub.Generate(request(i, 4), metadata=auth(), timeout=110)
    ids: list[int] = []
    try:
        async for chunk in call:
            ids.extend(chunk.token_ids)
            if chunk.finished:
                return "ok", (ids, chunk.finish_reason)
        return "no-final-chunk", ids
    except grpc.aio.AioRpcError as e:
        trailers = dict(e.trailing_metadata() or ())
        return e.code().name, (e.details(), trailers.get("retry-after"), trailers.get("grpc-retry-pushback-ms"))


async def cancel_after_first(stub: pb_grpc.GenerationStub, i: int) -> str:
    call = stub.Generate(request(i, 64), metadata=auth(), timeout=110)
    try:
        async for chunk in call:
            assert len(chunk.token_ids) == 1 and not chunk.finished
            call.cancel()
            return "cancelled"
        return "ended-without-chunk"
    except grpc.aio.AioRpcError as e:
        return e.code().name


def test_200_concurrent_streams_complete_or_are_told_to_back_off(grpc_server, grpc_stub, alone):
    t0 = time.monotonic()
    results = asyncio.run(many(grpc_server.grpc_address, CLIENTS, complete))
    elapsed = time.monotonic() - t0
    kinds = Counter(kind for kind, _ in results)
    assert set(kinds) <= {"ok", "RESOURCE_EXHAUSTED"}, kinds
    assert kinds["ok"] >= 32 and kinds["RESOURCE_EXHAUSTED"] >= 1, kinds  # both outcomes reached
    for i, (kind, detail) in enumerate(results):
        if kind == "ok":
            assert detail == (alone[i % len(PROMPTS)], "length"), (i, detail)
        else:
            details, retry_after, pushback = detail
            assert "48 requests are already waiting" in details and "retry after 1 s" in details
            assert (retry_after, pushback) == ("1", "1000")
    info = free_blocks_settle(grpc_stub)
    assert info.num_running == 0 and info.num_waiting == 0
    assert info.kv_blocks_free == info.kv_blocks_total, info
    print(f"\n{CLIENTS} clients: {dict(kinds)} in {elapsed:.1f} s")


def test_100_clients_cancelling_mid_stream_leave_no_trace(grpc_server, grpc_stub, alone):
    t0 = time.monotonic()
    results = asyncio.run(many(grpc_server.grpc_address, CANCELLERS, cancel_after_first))
    kinds = Counter(results)
    assert set(kinds) <= {"cancelled", "RESOURCE_EXHAUSTED"} and kinds["cancelled"] >= 32, kinds
    info = free_blocks_settle(grpc_stub)
    assert info.num_running == 0 and info.num_waiting == 0
    assert info.kv_blocks_free == info.kv_blocks_total, info
    again = [collect(grpc_stub.Generate(request(i, 4), metadata=auth(), timeout=60))[0] for i in range(len(PROMPTS))]
    assert again == alone
    print(f"\n{CANCELLERS} cancelling clients: {dict(kinds)} in {time.monotonic() - t0:.1f} s")


def test_200_concurrent_streams_on_the_default_cpu_config():
    server = start_server([], "grpc-default")
    try:
        with server.channel() as ch:
            stub = server.stub(ch)
            alone = [collect(stub.Generate(request(i, 4), metadata=auth(), timeout=60))[0]
                     for i in range(len(PROMPTS))]
            t0 = time.monotonic()
            results = asyncio.run(many(server.grpc_address, CLIENTS, complete))
            elapsed = time.monotonic() - t0
            info = free_blocks_settle(stub)
    finally:
        server.stop()
    kinds = Counter(kind for kind, _ in results)
    assert set(kinds) <= {"ok", "RESOURCE_EXHAUSTED"} and kinds["ok"] >= 1, kinds
    for i, (kind, detail) in enumerate(results):
        if kind == "ok":
            assert detail == (alone[i % len(PROMPTS)], "length"), (i, detail)
    assert info.num_running == 0 and info.num_waiting == 0 and info.max_waiting == 256
    assert info.kv_blocks_free == info.kv_blocks_total, info
    print(f"\n{CLIENTS} clients, default config: {dict(kinds)} in {elapsed:.1f} s")
