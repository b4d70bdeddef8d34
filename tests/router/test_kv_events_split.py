"""The KV-event stream with the services as separate processes (`nanokv up`): the cache service
publishes, the gateway relays on its public gRPC port, and the hashes are the request's own."""

from __future__ import annotations

import grpc
import httpx

from nanokv.cache_service.hashing import hash_full_blocks
from nanokv.protos import kv_events_pb2 as ev
from nanokv.protos import kv_events_pb2_grpc as ev_grpc
from tests.helpers_grpc import free_port
from tests.helpers_up import nanokv_up


def _first(stub: ev_grpc.KvEventsStub, req: ev.SubscribeRequest) -> ev.KvEventBatch:
    call = stub.Subscribe(req, timeout=60)
    batch = next(call)
    call.cancel()
    return batch


def test_the_gateway_relays_the_cache_services_events(tmp_path):
    grpc_port = free_port()
    prompt = list(range(100, 150))  # 3 full blocks of 16 (one token is always computed)
    with nanokv_up(tmp_path, "--grpc-port", str(grpc_port), "--block-size", "16") as base, \
            grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        stub = ev_grpc.KvEventsStub(ch)
        before = _first(stub, ev.SubscribeRequest())
        assert before.snapshot and before.block_size == 16
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                                        "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        after = _first(stub, ev.SubscribeRequest(stream_id=before.stream_id, after_seq=before.last_seq))
        assert not after.snapshot and after.stream_id == before.stream_id
        stored = [e.stored for e in after.events if e.HasField("stored")]
        want = hash_full_blocks(prompt, 16)
        assert [s.block_hashes[0] for s in stored][:3] == want
        assert stored[1].parent_block_hash == want[0] and stored[0].token_count == 16
        info = stub.GetRoutingInfo(ev.RoutingInfoRequest(), timeout=60)
        assert info.block_size == 16 and info.tokenizer_files and info.model == model
