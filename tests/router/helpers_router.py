"""Real replicas (`nanokv serve`: a gateway with its cache and compute in one process) and real
`nanokv router` processes for the router's tests, and the multi-turn chat workload they run."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.helpers_grpc import KEY_A, KEY_B, ROOT, Server, _stop, free_port, start_server

BLOCKS_PER_REPLICA = 64
REPLICA_FLAGS = ["--device", "cpu", "--dtype", "float32", "--block-size", "8", "--max-num-seqs", "16",
                 "--max-waiting", "256"]
HEADERS = {"Authorization": f"Bearer {KEY_A}"}
MODEL = "SmolLM2-135M-Instruct"


def start_replicas(blocks: list[int]) -> list[Server]:
    with ThreadPoolExecutor(len(blocks)) as ex:
        futs = [ex.submit(start_server, [*REPLICA_FLAGS, "--num-gpu-blocks", str(n)], f"router-replica{i}")
                for i, n in enumerate(blocks)]
        return [f.result() for f in futs]


def replica_spec(s: Server) -> str:
    return f"127.0.0.1:{s.http.rsplit(':', 1)[1]}:{s.grpc_address.rsplit(':', 1)[1]}"


@dataclass
class RouterProc:
    proc: subprocess.Popen
    http: str
    grpc_address: str
    log: Path

    def metrics(self) -> str:
        return httpx.get(f"{self.http}/metrics", headers=HEADERS, timeout=10).text

    def stop(self) -> None:
        _stop(self.proc)


def start_router(replicas: list[Server], routing: str, *extra: str) -> RouterProc:
    http_port, grpc_port = free_port(), free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"nanokv-router-{routing}-{os.getpid()}.log"
    out = open(log, "wb")  # noqa: SIM115 - the child keeps it
    cmd = [sys.executable, "-m", "nanokv.cli", "router", "--port", str(http_port), "--grpc-port", str(grpc_port),
           "--replicas", ",".join(replica_spec(s) for s in replicas), "--routing", routing,
           "--api-key", KEY_A, "--api-key", KEY_B, "--health-interval-s", "0.5", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, stdin=subprocess.DEVNULL)
    out.close()
    atexit.register(_stop, proc)
    r = RouterProc(proc, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", log)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"nanokv router exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            m = r.metrics()
            if f"nanokv_router_healthy_replicas {float(len(replicas))}" in m:
                return r
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router saw no healthy replicas in 60 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


# ---- the workload: multi-turn chats, one system prompt, a distinct user per conversation --------------
SYSTEM = "Help desk {tag}. Be brief."
TOPICS = ["rivers", "mountains", "violins", "trains", "bees", "clouds", "bridges", "tea", "chess", "comets"]


def first_message(i: int) -> str:
    a, b = TOPICS[i % 10], TOPICS[(i // 10) % 10]
    return f"Chat {i}: a fact about {a} and {b}?"


SECOND = "Simpler, please."


@dataclass
class Tally:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    answers: dict[int, list[str]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)


def chat(client: httpx.Client, base: str, messages: list[dict[str, str]], max_tokens: int = 2,
         key: str = KEY_A) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = client.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                    timeout=300)
    r.raise_for_status()
    return r.json()


def run_conversations(base: str, tag: str, n: int, workers: int = 16) -> Tally:
    """`n` two-turn conversations, `workers` at a time: turn 2 carries turn 1 and its answer."""
    tally = Tally()

    def one(i: int) -> None:
        with httpx.Client() as client:
            msgs = [{"role": "system", "content": SYSTEM.format(tag=tag)},
                    {"role": "user", "content": first_message(i)}]
            answers = []
            for turn in range(2):
                try:
                    out = chat(client, base, msgs)
                except httpx.HTTPError as e:
                    tally.errors.append(f"{i}/{turn}: {e}")
                    return
                if "usage" not in out:
                    tally.errors.append(f"{i}/{turn}: {out}")
                    return
                u = out["usage"]
                tally.prompt_tokens += u["prompt_tokens"]
                tally.cached_tokens += u["prompt_tokens_details"]["cached_tokens"]
                answers.append(out["choices"][0]["message"]["content"])
                msgs += [{"role": "assistant", "content": answers[-1]}, {"role": "user", "content": SECOND}]
            tally.answers[i] = answers

    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(one, range(n)))
    return tally
