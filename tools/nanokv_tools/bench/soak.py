"""`nanokv soak`: a bounded mixed run on loopback against cache, compute and gateway as three real
processes (nanokv_tools.bench.stack), with a compute service SIGKILL + restart in the middle.

    nanokv soak --minutes 10 [--clients 6] [--out soak.json]

Clients stream over the public gRPC API and the OpenAI HTTP API for two tenants (two API keys),
some cancelling part-way (nanokv_tools.bench.soak_clients). Meanwhile, every --probe-interval-s:
a prompt first seen by tenant A is sent by tenant B and by A with another cache_salt (both must get
0 cached tokens: no cross-tenant prefix hit) and by A again (must hit: the probe can see a hit);
every --rss-interval-s the resident memory of each process is sampled. A greedy prompt is answered
at the start, after the restart and at the end: the same tokens each time. At the end, once the
clients are gone: the cache service must hold no sequence and no block (leaked blocks 0), the
compute service no sequence table.

Prints a summary and writes it as JSON. Exit status 0 when every invariant held.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from nanokv.protos import internal_pb2 as ipb
from nanokv.protos import internal_pb2_grpc as ipb_grpc
from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.protos import nanokv_v1_pb2_grpc as pb_grpc
from nanokv.rpc import channel
from nanokv_tools.bench.soak_clients import Tally, client_loop, grpc_generate, http_generate
from nanokv_tools.bench.stack import Stack

KEYS = ("soak-tenant-a", "soak-tenant-b")
CONFIG = {"num_gpu_blocks": 256, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 256}
GREEDY_PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
PROBE_TEXT = ("is a probe of the prefix cache: this text is long enough to fill several blocks of sixteen "
              "tokens each, so that a hit would show as a whole number of blocks in the cached count.")


SOAK_ARGS = ("minutes", "clients", "kill_at", "rss_interval_s", "warmup_s", "probe_interval_s", "seed")


def add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="length of the mixed run")
    p.add_argument("--clients", type=int, default=6, help="concurrent clients, one request each at a time")
    p.add_argument("--kill-at", type=float, default=0.5,
                   help="fraction of the run at which the compute service is SIGKILLed and restarted (<0: never)")
    p.add_argument("--rss-interval-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=60.0,
                   help="RSS samples of a process's first seconds are not judged (model load, first steps)")
    p.add_argument("--probe-interval-s", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="soak.json", help="where the JSON summary goes")


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Soak:
    def __init__(self, stack: Stack, args: argparse.Namespace, log: Callable[[str], None]):
        self.stack, self.args, self.log = stack, args, log
        self.channel = grpc.insecure_channel(stack.grpc_address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.t0 = time.monotonic()
        self.started = {stack.pid(k): (k, 0.0) for k in ("cache", "compute", "gateway")}  # pid -> (kind, t)
        self.rss: dict[int, list[tuple[float, float]]] = {}
        self.probes = {"run": 0, "skipped": 0, "cross_tenant_hit_tokens": 0, "cross_salt_hit_tokens": 0,
                       "same_tenant_hits": 0}
        self.greedy: list[list[int]] = []
        self.restart: dict[str, Any] = {}
        md = (("authorization", f"Bearer {KEYS[0]}"),)
        self.model = self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=30).name

    def now(self) -> float:
        return time.monotonic() - self.t0

    def sample_rss(self) -> None:
        for kind in ("cache", "compute", "gateway"):
            pid = self.stack.pid(kind)
            mib = rss_mib(pid)
            if mib is not None:
                self.rss.setdefault(pid, []).append((self.now(), mib))

    def greedy_probe(self, when: str) -> None:
        for _ in range(40):  # a restart may still be settling: retry briefly
            outcome, ids, _ = grpc_generate(self.stub, KEYS[0], GREEDY_PROMPT, 16, greedy=True)
            if outcome == "ok":
                self.greedy.append(ids)
                self.log(f"[{self.now():6.0f} s] greedy probe ({when}): {ids}")
                return
            time.sleep(0.5)
        raise RuntimeError(f"greedy probe ({when}) never succeeded: {outcome}")

    def tenant_probe(self, n: int) -> None:
        text = f"Probe {n} {os.getpid()} {PROBE_TEXT}"  # its first block is new to every tenant and salt
        port = self.stack.http_port
        first, _, _ = grpc_generate(self.stub, KEYS[0], text, 2, greedy=True)
        other, _, cached_other = http_generate(port, self.model, KEYS[1], text, 2, greedy=True)
        salted, _, cached_salted = grpc_generate(self.stub, KEYS[0], text, 2, greedy=True, salt="other-salt")
        again, _, cached_again = http_generate(port, self.model, KEYS[0], text, 2, greedy=True)
        if (first, other, salted, again) != ("ok",) * 4:
            self.probes["skipped"] += 1  # a service was down meanwhile
            return
        self.probes["run"] += 1
        self.probes["cross_tenant_hit_tokens"] += cached_other
        self.probes["cross_salt_hit_tokens"] += cached_salted
        self.probes["same_tenant_hits"] += cached_again > 0

    def kill_and_restart_compute(self) -> None:
        t = self.now()
        self.log(f"[{t:6.0f} s] SIGKILL compute (pid {self.stack.pid('compute')})")
        self.stack.kill("compute")
        self.stack.restart("compute")
        ready = self.stack.wait_ready(300)
        self.started[self.stack.pid("compute")] = ("compute", self.now())
        self.restart = {"killed_at_s": round(t, 1), "ready_after_s": round(self.now() - t, 2),
                        "gateway_ready_wait_s": round(ready, 2)}
        self.log(f"[{self.now():6.0f} s] compute restarted (pid {self.stack.pid('compute')}), gateway ready")
        self.greedy_probe("after the restart")

    def leaks(self) -> dict[str, int]:
        """After the clients are gone: what the services still hold (waits up to 30 s for aborts)."""
        deadline = time.monotonic() + 30
        with channel(self.stack.cache_address) as cch, channel(self.stack.compute_address) as mch:
            while True:
                cs = ipb_grpc.CacheStub(cch).Stats(ipb.Empty(), timeout=30)
                ms = ipb_grpc.ComputeStub(mch).Stats(ipb.Empty(), timeout=30)
                out = {"leaked_blocks": int(cs.kv_blocks_total - cs.kv_blocks_free), "cache_num_seqs": int(cs.num_seqs),
                       "compute_num_seqs": int(ms.num_seqs), "kv_blocks_total": int(cs.kv_blocks_total)}
                if not (out["leaked_blocks"] or out["cache_num_seqs"] or out["compute_num_seqs"]) \
                        or time.monotonic() > deadline:
                    return out
                time.sleep(0.2)

    def rss_summary(self) -> list[dict[str, Any]]:
        out = []
        for pid, samples in self.rss.items():
            kind, started = self.started.get(pid, ("?", 0.0))
            judged = [mib for t, mib in samples if t - started >= self.args.warmup_s]
            if not judged:
                continue
            out.append({"process": kind, "pid": pid, "samples": len(judged), "first_mib": round(judged[0], 1),
                        "last_mib": round(judged[-1], 1), "max_mib": round(max(judged), 1),
                        "growth_mib": round(judged[-1] - judged[0], 1)})
        return out

    def run(self) -> dict[str, Any]:
        args = self.args
        duration = args.minutes * 60
        self.greedy_probe("start")
        stop = threading.Event()
        tally = Tally()
        clients = [threading.Thread(target=client_loop, daemon=True, name=f"soak-client-{i}",
                                    args=(stop, tally, self.channel, self.stack.http_port, self.model, KEYS,
                                          args.seed + i)) for i in range(args.clients)]
        for c in clients:
            c.start()
        kill_at = duration * args.kill_at if args.kill_at >= 0 else None
        next_rss = next_probe = 0.0
        n = 0
        while self.now() < duration:
            if kill_at is not None and self.now() >= kill_at:
                kill_at = None
                self.kill_and_restart_compute()
            if self.now() >= next_rss:
                next_rss = self.now() + args.rss_interval_s
                self.sample_rss()
            if self.now() >= next_probe:
                next_probe = self.now() + args.probe_interval_s
                self.tenant_probe(n := n + 1)
                self.log(f"[{self.now():6.0f} s] {tally.by_outcome()}, probes {self.probes}")
            time.sleep(0.2)
        stop.set()
        for c in clients:
            c.join(300)
        self.sample_rss()
        self.greedy_probe("end")
        leaks = self.leaks()
        result = {
            "args": {k: v for k, v in vars(args).items() if k in SOAK_ARGS},
            "minutes": args.minutes, "clients": args.clients, "config": CONFIG,
            "requests": tally.by_outcome(),
            "requests_by_api": {f"{api} {o}": k for (api, o), k in sorted(tally.outcomes.items())},
            "tokens_streamed": tally.tokens, **leaks, "tenant_probes": self.probes,
            "greedy_probes": len(self.greedy), "greedy_mismatches": sum(g != self.greedy[0] for g in self.greedy),
            "compute_restart": self.restart, "rss": self.rss_summary(),
        }
        result["ok"] = (leaks["leaked_blocks"] == 0 and leaks["cache_num_seqs"] == 0 and leaks["compute_num_seqs"] == 0
                        and self.probes["cross_tenant_hit_tokens"] == 0 and self.probes["cross_salt_hit_tokens"] == 0
                        and self.probes["run"] > 0 and self.probes["same_tenant_hits"] == self.probes["run"]
                        and result["greedy_mismatches"] == 0 and all(c.is_alive() is False for c in clients))
        self.channel.close()
        return result


def run_soak(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    run_dir = tempfile.mkdtemp(prefix="nanokv-soak-")
    try:
        with Stack.start(dict(CONFIG), run_dir, api_keys=KEYS) as stack:
            stack.wait_ready(300)
            log(f"services up (cache {stack.pid('cache')}, compute {stack.pid('compute')}, "
                f"gateway {stack.pid('gateway')}); {args.minutes:g} min, {args.clients} clients")
            return Soak(stack, args, log).run()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def print_summary(r: dict[str, Any]) -> None:
    print(f"requests: {r['requests']}  (tokens streamed {r['tokens_streamed']})")
    print(f"leaked blocks: {r['leaked_blocks']} of {r['kv_blocks_total']}; sequences left: cache "
          f"{r['cache_num_seqs']}, compute {r['compute_num_seqs']}")
    p = r["tenant_probes"]
    print(f"tenant probes: {p['run']} run ({p['skipped']} skipped during the outage); cross-tenant hit tokens "
          f"{p['cross_tenant_hit_tokens']}, cross-salt {p['cross_salt_hit_tokens']}; same-tenant hits "
          f"{p['same_tenant_hits']}")
    print(f"greedy probes: {r['greedy_probes']}, mismatches {r['greedy_mismatches']}; compute restart: "
          f"{r['compute_restart']}")
    for x in r["rss"]:
        print(f"RSS {x['process']:8s} pid {x['pid']:>7}: first {x['first_mib']:.1f} MiB, last {x['last_mib']:.1f}, "
              f"max {x['max_mib']:.1f} ({x['samples']} samples after warm-up)")
    print("all invariants held" if r["ok"] else "INVARIANT BROKEN")


def main(args: argparse.Namespace) -> int:
    result = run_soak(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print_summary(result)
    print(f"wrote {args.out}")
    return 0 if result["ok"] else 1


def command(argv: list[str]) -> int:
    """`nanokv soak ...` (an entry point of group nanokv.commands)."""
    p = argparse.ArgumentParser(prog="nanokv soak", description="a bounded mixed run against the three services, "
                                "a compute restart in it")
    add_soak_args(p)
    return main(p.parse_args(argv))
