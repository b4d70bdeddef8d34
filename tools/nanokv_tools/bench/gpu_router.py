"""Two replicas on one GPU behind `nanokv router`: KV-aware routing against round-robin on the same
multi-turn workload with arrival times, side by side in one run (docs/operating.md, many replicas).

    python -m nanokv_tools.bench.gpu_router --out out/router.json [--model random:llama3-8b]

For each routing policy, two `nanokv serve` replicas start on the GPU (each with its own KV pool of
--blocks blocks, so the two split the memory), then a router in front of them, and `nanokv bench
serve` replays the chat workload at --rate through the router's nanokv.v1 gRPC API (token ids: a
random-weight model has no tokenizer). Fresh replicas per policy: neither run inherits the other's
cache. TTFT, TPOT, output tok/s and the prefix hit ratio come from the bench's JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

from nanokv_tools.bench.gpu_tiers import chat_bench_args, read_summaries
from nanokv_tools.bench.serve_launch import _free_port, launch


@contextlib.contextmanager
def router(replicas: list[str], routing: str, log_path: str) -> Iterator[str]:
    """`nanokv router` over `replicas` (HOST:HTTP:GRPC); yields its gRPC address once both are healthy."""
    http_port, grpc_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "nanokv.cli", "router", "--port", str(http_port), "--grpc-port", str(grpc_port),
           "--replicas", ",".join(replicas), "--routing", routing, "--health-interval-s", "0.5",
           "--log-level", "warning"]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"nanokv router exited with {proc.returncode}: {open(log_path).read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=2) as r:
                    if f"nanokv_router_healthy_replicas {float(len(replicas))}" in r.read().decode():
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the router saw no healthy replicas in 120 s")
            time.sleep(0.3)
        yield f"127.0.0.1:{grpc_port}"
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def start_together(ctxs: list[Any], stack: contextlib.ExitStack) -> list[Any]:
    """Enter the replicas' launch contexts side by side (each start loads a model: ~70 s for random
    Llama-3-8B weights on an H100), each registered on `stack` once it is up."""
    def enter(c: Any) -> Any:
        up = c.__enter__()
        stack.push(c)
        return up

    with concurrent.futures.ThreadPoolExecutor(len(ctxs)) as ex:
        return list(ex.map(enter, ctxs))


def run_policy(args: argparse.Namespace, routing: str, out_dir: str) -> list[dict[str, Any]]:
    server = f"--model {args.model} --num-gpu-blocks {args.blocks} --max-num-seqs {args.max_num_seqs}"
    path = os.path.join(out_dir, f"router_{routing}.json")
    with contextlib.ExitStack() as stack:
        reps = start_together([launch("serve", server, 900) for _ in range(2)], stack)
        specs = [f"127.0.0.1:{r.base_url.rsplit(':', 1)[1]}:{r.grpc_address.rsplit(':', 1)[1]}" for r in reps]
        address = stack.enter_context(router(specs, routing, os.path.join(out_dir, f"router_{routing}.log")))
        cmd = [sys.executable, "-m", "nanokv_tools.bench.serve", "--backend", "grpc", "--grpc-address", address,
               *chat_bench_args(args, path)]
        print("===", routing, " ".join(cmd), flush=True)
        rc = subprocess.call(cmd)
    return [{"routing": routing, "rc": rc, **row} for row in read_summaries(path) or [{}]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--out", default="router.json")
    p.add_argument("--blocks", type=int, default=3072, help="each replica's device pool, in 16-token blocks")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--systems", type=int, default=32, help="system prompts (one per conversation at most)")
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--user-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--rate", default="4", help="request rates, comma-separated, each a run against the same replicas")
    p.add_argument("--routings", default="round_robin,kv")
    p.add_argument("--token-range", default="1000:120000", help="LO:HI token ids (within the vocabulary)")
    args = p.parse_args(argv)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    result: dict[str, Any] = {"args": vars(args), "runs": []}
    for routing in args.routings.split(","):
        for r in run_policy(args, routing, out_dir):
            result["runs"].append(r)
            print(json.dumps(r), flush=True)
    result["ttft_p50_rr_over_kv"] = {}
    for kv in (r for r in result["runs"] if r["routing"] == "kv" and r.get("median_ttft_ms")):
        rr = next((r for r in result["runs"] if r["routing"] == "round_robin" and r.get("rate") == kv.get("rate")
                   and r.get("median_ttft_ms")), None)
        if rr is not None:
            result["ttft_p50_rr_over_kv"][kv["rate"]] = rr["median_ttft_ms"] / kv["median_ttft_ms"]
            print(f"rate {kv['rate']}: TTFT p50 round_robin / kv:",
                  round(result["ttft_p50_rr_over_kv"][kv["rate"]], 2), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
