"""`nanokv router` over three real replicas (each a `nanokv serve`: gateway, cache and compute in one
process, the embedded model on CPU), against one replica holding their total capacity.

Order matters and is kept by the module: the workloads first, the SIGKILL of a replica last."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from nanokv.protos import kv_events_pb2 as ev
from nanokv.protos import kv_events_pb2_grpc as ev_grpc
from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.protos import nanokv_v1_pb2_grpc as pb_grpc
from tests.helpers_grpc import KEY_A, KEY_B, auth
from tests.router.helpers_router import (
    BLOCKS_PER_REPLICA,
    HEADERS,
    chat,
    run_conversations,
    start_replicas,
    start_router,
)

CONVERSATIONS = 200


@pytest.fixture(scope="module")
def stack():
    servers = start_replicas([BLOCKS_PER_REPLICA] * 3 + [3 * BLOCKS_PER_REPLICA])
    replicas, single = servers[:3], servers[3]
    routers = []
    try:
        routers = [start_router(replicas, "kv"), start_router(replicas, "round_robin")]
        yield replicas, single, routers[0], routers[1]
    finally:
        for r in routers:
            r.stop()
        for s in servers:
            s.stop()


def test_kv_routing_keeps_the_hit_ratio_of_one_big_replica(stack):
    replicas, single, kv, rr = stack
    t0 = time.monotonic()
    # the single replica's run beside the kv router's, the same conversations (their own processes);
    # round-robin after kv, on the same three replicas, under another system prompt of the same length
    # (the kv run's blocks are older: LRU drops them first)
    with ThreadPoolExecutor(2) as ex:
        one_f = ex.submit(run_conversations, single.http, "A", CONVERSATIONS)
        routed = run_conversations(kv.http, "A", CONVERSATIONS)
        robin = run_conversations(rr.http, "B", CONVERSATIONS)
        one = one_f.result()
    print(f"\nprefix hit ratio over {CONVERSATIONS} two-turn conversations: one replica of "
          f"{3 * BLOCKS_PER_REPLICA} blocks {one.hit_ratio:.3f}, kv routing over 3 x {BLOCKS_PER_REPLICA} "
          f"{routed.hit_ratio:.3f}, round-robin {robin.hit_ratio:.3f} ({time.monotonic() - t0:.0f} s)")
    assert not (one.errors or routed.errors or robin.errors), (one.errors + routed.errors + robin.errors)[:5]
    assert len(routed.answers) == CONVERSATIONS
    assert routed.prompt_tokens == one.prompt_tokens  # the same greedy answers, hence the same second turns
    assert routed.hit_ratio >= 0.95 * one.hit_ratio, (routed.hit_ratio, one.hit_ratio)
    assert robin.hit_ratio < routed.hit_ratio  # the comparison means something: affinity is what pays
    m = kv.metrics()
    per_replica = [line for line in m.splitlines() if line.startswith("nanokv_router_requests_total{")]
    assert len(per_replica) == 3, per_replica  # every replica got work
    assert "nanokv_router_predicted_hit_tokens_total" in m


def test_greedy_answers_through_the_router_are_the_engines(stack):
    """A sample, one at a time: the router forwards, the replica's engine answers as it answers directly."""
    replicas, single, kv, _ = stack
    with httpx.Client() as client:
        for i in range(4):
            msgs = [{"role": "user", "content": f"Name {i + 2} colours of the rainbow."}]
            direct = chat(client, single.http, msgs, max_tokens=12)["choices"][0]["message"]["content"]
            routed = chat(client, kv.http, msgs, max_tokens=12)["choices"][0]["message"]["content"]
            assert routed == direct and direct
    # the gRPC front too, token ids and all
    with grpc.insecure_channel(kv.grpc_address) as ch, grpc.insecure_channel(single.grpc_address) as ch2:
        req = pb.GenerateRequest(text="The capital of France is", sampling_params=pb.SamplingParams(
            max_tokens=8, temperature=0))
        a = [c for c in pb_grpc.GenerationStub(ch).Generate(req, metadata=auth(), timeout=120)]
        b = [c for c in pb_grpc.GenerationStub(ch2).Generate(req, metadata=auth(), timeout=120)]
        assert [t for c in a for t in c.token_ids] == [t for c in b for t in c.token_ids]
        assert a[-1].finished and a[-1].usage.prompt_tokens == b[-1].usage.prompt_tokens


def test_no_cross_tenant_hit_through_the_router(stack):
    _, _, kv, _ = stack
    msgs = [{"role": "user", "content": "Tenant isolation check: " + "a long shared preamble sentence. " * 12}]
    with httpx.Client() as client:
        chat(client, kv.http, msgs, key=KEY_A)
        time.sleep(0.3)  # (the events of the first reach the router)
        again = chat(client, kv.http, msgs, key=KEY_A)["usage"]["prompt_tokens_details"]["cached_tokens"]
        other = chat(client, kv.http, msgs, key=KEY_B)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert again > 0  # the same tenant hits (so the next line can fail)
    assert other == 0


def test_event_stream_resumes_by_sequence_number(stack):
    replicas, _, _, _ = stack
    with grpc.insecure_channel(replicas[0].grpc_address) as ch:
        stub = ev_grpc.KvEventsStub(ch)

        def first_batches(req: ev.SubscribeRequest, n: int = 1) -> list[ev.KvEventBatch]:
            call = stub.Subscribe(req, metadata=auth(), timeout=30)
            out = [next(call) for _ in range(n)]
            call.cancel()
            return out

        snap = first_batches(ev.SubscribeRequest())[0]  # a first subscription: a snapshot
        assert snap.snapshot and snap.events[0].HasField("cleared") and snap.block_size == 8
        assert snap.hash_algo == "sha256" and len(snap.events) > 1  # the workloads left blocks cached
        # new blocks on replica 0, then resume after the snapshot: the rest, in order, no snapshot
        with httpx.Client() as client:
            chat(client, replicas[0].http, [{"role": "user", "content": "Resume check " * 20}], max_tokens=2)
        nxt = first_batches(ev.SubscribeRequest(stream_id=snap.stream_id, after_seq=snap.last_seq))[0]
        assert not nxt.snapshot and nxt.events[0].seq == snap.last_seq + 1
        seqs = [e.seq for e in nxt.events]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert any(e.HasField("stored") and e.stored.medium == "GPU" and len(e.stored.block_hashes[0]) == 32
                   for e in nxt.events)
        # another stream's numbering (as after a cache restart): a snapshot again
        assert first_batches(ev.SubscribeRequest(stream_id="not-this-one", after_seq=nxt.last_seq))[0].snapshot


def test_sigkill_of_a_replica_mid_run(stack):
    """Streams on the killed replica end with a status (UNAVAILABLE / an SSE error event), the others
    finish, and new requests go to the two left."""
    replicas, _, kv, _ = stack
    victim = replicas[0]
    outcomes: list[str] = []
    lock = threading.Lock()
    started = threading.Semaphore(0)

    def grpc_stream(i: int) -> None:
        with grpc.insecure_channel(kv.grpc_address) as ch:
            req = pb.GenerateRequest(text=f"Write a long story about dragon {i}.", sampling_params=pb.SamplingParams(
                max_tokens=80, temperature=0, ignore_eos=True))
            first = True
            try:
                for _ in pb_grpc.GenerationStub(ch).Generate(req, metadata=auth(), timeout=240):
                    if first:
                        started.release()
                        first = False
                result = "ok"
            except grpc.RpcError as e:
                result = e.code().name
            if first:
                started.release()
        with lock:
            outcomes.append(result)

    def sse_stream(i: int) -> None:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": f"Once upon a time, knight {i}", "max_tokens": 80,
                "temperature": 0, "ignore_eos": True, "stream": True}
        text = ""
        with httpx.stream("POST", f"{kv.http}/v1/completions", json=body, headers=HEADERS, timeout=240) as r:
            for chunk in r.iter_text():
                if not text:
                    started.release()
                text += chunk
        with lock:
            outcomes.append("ok" if text.rstrip().endswith("[DONE]") else
                            "sse_error" if '"error"' in text else f"cut: {text[-200:]!r}")

    threads = [threading.Thread(target=grpc_stream, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=sse_stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=120)
    victim.proc.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(timeout=200)
    assert not any(t.is_alive() for t in threads), "a stream hung after its replica died"
    assert len(outcomes) == 6 and set(outcomes) <= {"ok", "UNAVAILABLE", "sse_error"}, outcomes
    assert any(o != "ok" for o in outcomes), outcomes  # one of six streams, at least, was on the victim
    # within one health interval (0.5 s) new requests go to the two left, and every one completes
    time.sleep(0.6)
    with httpx.Client() as client:
        for i in range(6):
            out = chat(client, kv.http, [{"role": "user", "content": f"After the crash {i}"}], max_tokens=3)
            assert out["choices"][0]["finish_reason"] in ("length", "stop")
    assert 'nanokv_router_replica_healthy{replica="127.0.0.1:' in kv.metrics()
    assert "nanokv_router_healthy_replicas 2.0" in kv.metrics()
