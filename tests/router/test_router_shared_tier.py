"""`nanokv router` over two real replicas that share a real Valkey/Redis server (`remote_cache_url`):
a conversation's replica dies and its next turn, sent through the router, lands on the other replica
and loads its prefix from the shared tier, with the greedy tokens of a cold prefill; another tenant
(API key or cache_salt) gets none of it. The replicas' small L1 and L2 push the conversation's blocks
down to the server within a few requests; their KV events name every tier the blocks pass through.
(A stream on a killed replica ending with a status: tests/router/test_router.py.)"""

from __future__ import annotations

import re
import signal
import time

import grpc
import httpx
import pytest

from nanokv.protos import kv_events_pb2 as ev
from nanokv.protos import kv_events_pb2_grpc as ev_grpc
from tests.helpers_grpc import KEY_A, KEY_B, auth, start_server
from tests.helpers_valkey import Server as Valkey
from tests.helpers_valkey import require_server
from tests.router.helpers_router import MODEL, REPLICA_FLAGS, start_router

BLOCK_BYTES = 30 * 3 * 64 * 2 * 4 * 8  # SmolLM2-135M, fp32 on the CPU, 8-token blocks: 368,640 bytes
# L1 of 32 blocks (256 tokens) and L2 of 24: filler prompts of 22 blocks push a conversation's blocks
# through L2 to the shared tier (an L2 victim no lower tier takes goes to the server). L2 holds more
# than one prompt's evictions: a victim whose bytes came down in the same plan is not settled yet and
# is dropped, not written (tiers/serving.py). LRU in L1: clock (the default) would give the
# conversation's blocks, hit on its second turn, a second chance over the fillers'.
TIER_FLAGS = ["--num-gpu-blocks", "32", "--eviction-policy", "lru", "--cpu-offload-bytes", str(24 * BLOCK_BYTES),
              "--max-num-seqs", "4", "--no-async-scheduling"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    valkey = Valkey(require_server(), tmp_path_factory.mktemp("valkey")).start()
    flags = [*REPLICA_FLAGS, *TIER_FLAGS, "--remote-cache-url", valkey.url]
    replicas, router = [], None
    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as ex:
            replicas = list(ex.map(lambda i: start_server(flags, f"shared-tier-replica{i}"), range(2)))
        router = start_router(replicas, "kv")
        yield replicas, router
    finally:
        if router is not None:
            router.stop()
        for s in replicas:
            s.stop()
        valkey.stop()


def _routed(router_metrics: str) -> dict[str, float]:
    """Requests the router sent per replica (HTTP port -> count), from its /metrics."""
    out: dict[str, float] = {}
    for m in re.finditer(r'nanokv_router_requests_total\{[^}]*replica="[^"]*:(\d+):\d+"[^}]*\} (\S+)', router_metrics):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _chat(client: httpx.Client, base: str, messages: list[dict[str, str]], key: str = KEY_A, **extra) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    r = client.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                    timeout=300)
    r.raise_for_status()
    return r.json()


def _media(replica) -> dict[str, int]:
    """BlockStored events per medium in a fresh subscription's snapshot of the replica's cache."""
    with grpc.insecure_channel(replica.grpc_address) as ch:
        call = ev_grpc.KvEventsStub(ch).Subscribe(ev.SubscribeRequest(), metadata=auth(), timeout=30)
        snap = next(call)
        call.cancel()
    assert snap.snapshot and list(snap.shared_media) == ["REMOTE"]
    out: dict[str, int] = {}
    for e in snap.events:
        if e.HasField("stored"):
            out[e.stored.medium] = out.get(e.stored.medium, 0) + 1
    return out


def test_a_dead_replicas_conversation_resumes_from_the_shared_tier(stack):
    replicas, router = stack
    port = {r.http.rsplit(":", 1)[1]: r for r in replicas}
    msgs = [{"role": "system", "content": "You answer in one short sentence about geography."},
            {"role": "user", "content": "Which river flows through Vienna, Budapest and Belgrade?"}]
    with httpx.Client() as client:
        before = _routed(router.metrics())
        for turn in ("And which sea does it reach?", "Name one country it crosses."):
            out = _chat(client, router.http, msgs)
            msgs += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                     {"role": "user", "content": turn}]
            time.sleep(0.3)  # (its events reach the router: the next turn follows its prefix)
        after = _routed(router.metrics())
        served = [p for p in after if after[p] - before.get(p, 0.0) > 0]
        assert len(served) == 1, (before, after)  # both turns on one replica: its prefix was there
        home = port[served[0]]
        other = next(r for r in replicas if r is not home)
        # fillers sent straight to the home replica push the conversation's blocks out of its L1 and L2
        for i in range(5):
            _chat(client, home.http, [{"role": "user", "content": f"Filler {i}: " + "count the stars. " * 30}],
                  max_tokens=1)
        time.sleep(1.0)  # (the shared tier's writer thread puts them on the server)
        media = _media(home)
        assert media.get("GPU", 0) > 0 and media.get("CPU", 0) > 0 and media.get("REMOTE", 0) > 0, media
        home.proc.send_signal(signal.SIGKILL)
        home.proc.wait(30)
        deadline = time.monotonic() + 20
        while "nanokv_router_healthy_replicas 1.0" not in router.metrics():
            assert time.monotonic() < deadline, "the router did not take the killed replica out"
            time.sleep(0.2)
        before = _routed(router.metrics())
        resumed = _chat(client, router.http, msgs)
        assert _routed(router.metrics()).get(other.http.rsplit(":", 1)[1], 0.0) > before.get(
            other.http.rsplit(":", 1)[1], 0.0)
        details = resumed["usage"]["prompt_tokens_details"]
        remote_metrics = [ln for ln in client.get(f"{other.http}/metrics", headers={"Authorization": f"Bearer {KEY_A}"},
                                                  timeout=10).text.splitlines() if "remote" in ln and ln[0] != "#"]
        assert details["cached_tokens"] > 0 and (details["cached_tokens_by_tier"] or {}).get("remote", 0) > 0, \
            (details, remote_metrics)
        # the same prompt computed cold (another tenant: nothing of the conversation's is its own)
        cold_b = _chat(client, router.http, msgs, key=KEY_B)
        cold_salt = _chat(client, router.http, msgs, cache_salt="another-conversation")
        for cold in (cold_b, cold_salt):
            assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, cold["usage"]
            assert cold["choices"][0]["message"]["content"] == resumed["choices"][0]["message"]["content"]
        assert resumed["choices"][0]["message"]["content"]
