"""The soak's clients: one request at a time each, over the public gRPC API or the OpenAI HTTP API
(streamed), some cancelled part-way; and the probes that check the run's invariants.

Every request ends in exactly one outcome: "ok", "cancelled" (the client left on purpose) or the
failure's status ("grpc:UNAVAILABLE", "http:503", ...). No torch, no third-party HTTP client.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc

from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.protos import nanokv_v1_pb2_grpc as pb_grpc

# a long shared preamble per tenant: requests of one tenant share its prefix blocks
PREAMBLE = ("You are a careful assistant. Answer briefly and precisely, in plain English, without lists. "
            "Facts: the Danube flows through ten countries; the Rhine rises in the Swiss Alps; the Loire is "
            "the longest river in France; the Thames flows through London. ")
QUESTIONS = ["Which river flows through London?", "Where does the Rhine rise?", "Name a long river in France.",
             "How many countries does the Danube cross?", "Which of these rivers is in Switzerland?",
             "Write one sentence about rivers.", "What is a delta?", "Name two capitals on rivers."]


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: Counter = field(default_factory=Counter)  # (api, outcome) -> requests
    tokens: int = 0

    def add(self, api: str, outcome: str, tokens: int = 0) -> None:
        with self.lock:
            self.outcomes[(api, outcome)] += 1
            self.tokens += tokens

    def by_outcome(self) -> dict[str, int]:
        out: Counter = Counter()
        for (_, outcome), n in self.outcomes.items():
            out[outcome] += n
        return dict(sorted(out.items()))


def grpc_generate(stub: pb_grpc.GenerationStub, key: str, text: str, max_tokens: int, *, greedy: bool = False,
                  cancel_after: int | None = None, salt: str = "") -> tuple[str, list[int], int]:
    """(outcome, token ids, cached prompt tokens)."""
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else 0.8, ignore_eos=greedy)
    call = stub.Generate(pb.GenerateRequest(text=text, sampling_params=params, cache_salt=salt),
                         metadata=(("authorization", f"Bearer {key}"),), timeout=300)
    ids: list[int] = []
    cached = 0
    try:
        for chunk in call:
            ids.extend(chunk.token_ids)
            if chunk.finished:
                cached = chunk.usage.cached_prompt_tokens
            if cancel_after is not None and len(ids) >= cancel_after and not chunk.finished:
                call.cancel()
                return "cancelled", ids, 0
    except grpc.RpcError as e:
        code = e.code()
        return ("cancelled" if code == grpc.StatusCode.CANCELLED and cancel_after is not None
                else f"grpc:{code.name if code is not None else 'UNKNOWN'}"), ids, 0
    return "ok", ids, cached


def http_generate(port: int, model: str, key: str, text: str, max_tokens: int, *, greedy: bool = False,
                  cancel_after: int | None = None, salt: str = "") -> tuple[str, int, int]:
    """(outcome, chunks with text, cached prompt tokens) of a streamed /v1/completions."""
    body: dict[str, Any] = {"model": model, "prompt": text, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.0 if greedy else 0.8,
                            "ignore_eos": greedy}
    if salt:
        body["cache_salt"] = salt
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            r.read()
            return f"http:{r.status}", 0, 0
        chunks = cached = 0
        done = False
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                return f"http:stream-error:{event['error'].get('code')}", chunks, 0
            if event.get("usage"):
                cached = ((event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            if event.get("choices"):
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    return "cancelled", chunks, 0  # closing the connection aborts the request
        return ("ok" if done else "http:truncated"), chunks, cached
    except (OSError, http.client.HTTPException) as e:
        return f"http:{type(e).__name__}", 0, 0
    finally:
        conn.close()


def client_loop(stop: threading.Event, tally: Tally, channel: grpc.Channel, http_port: int, model: str,
                keys: tuple[str, str], seed: int, cancel_fraction: float = 0.2) -> None:
    rng = random.Random(seed)
    stub = pb_grpc.GenerationStub(channel)
    while not stop.is_set():
        tenant = rng.randrange(2)
        text = PREAMBLE + rng.choice(QUESTIONS) + f" (#{rng.randrange(1000)})"
        max_tokens = rng.randint(8, 40)
        cancel_after = rng.randint(1, 6) if rng.random() < cancel_fraction else None
        if rng.random() < 0.5:
            outcome, ids, _ = grpc_generate(stub, keys[tenant], text, max_tokens, cancel_after=cancel_after)
            tally.add("grpc", outcome, len(ids))
        else:
            outcome, n, _ = http_generate(http_port, model, keys[tenant], text, max_tokens, cancel_after=cancel_after)
            tally.add("http", outcome, n)
        if outcome not in ("ok", "cancelled"):
            stop.wait(0.25)  # a service is down: back off a little, as a client told 503 would
