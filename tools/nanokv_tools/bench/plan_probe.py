"""What one plan costs, in process and over gRPC: 256 sequences decoding, no model.

    python -m nanokv_tools.bench.plan_probe [--num-seqs 256] [--steps 300]

Drives the gateway's Scheduler against a CacheService in this process, then against a `nanokv cache`
process over a unix socket (the same planner behind both), and prints the median time of a decode
step's plan call: the rest of a step (forward pass, sampling) is not run, so this is the host cost
the pipeline has to hide. No torch: the pool is a small shared-memory segment.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

from nanokv.cache_service.service import CacheService
from nanokv.config import EngineConfig
from nanokv.gateway.clients import CacheClient
from nanokv.gateway.scheduler import Scheduler
from nanokv.gateway.sequence import Sequence
from nanokv.messages import PoolLayout
from nanokv.protos import codec
from nanokv.protos import internal_pb2 as pb
from nanokv.sampling import SamplingParams

BLOCKS = 40000


def _drive(cache: Any, num_seqs: int, steps: int) -> list[float]:
    """Per-step seconds in Scheduler.schedule() (the plan call) once every sequence decodes."""
    sched = Scheduler(cache, max_num_seqs=num_seqs, max_num_batched_tokens=16384)
    rng = random.Random(0)
    for i in range(num_seqs):
        prompt = [rng.randrange(50000) for _ in range(rng.randrange(100, 1000))]
        sched.add(Sequence(i, str(i), prompt, SamplingParams(max_tokens=4096, ignore_eos=True), 4096))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        times.append(time.perf_counter() - t0)
        sampled = [s.seq for s in out.scheduled if s.samples]
        sched.update(out)
        for seq in sampled:
            tok = rng.randrange(50000)
            seq.append_token(tok)
            sched.note_token(seq, tok)
    return sorted(times[steps // 3:])  # the prefills are over by then


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    layout = PoolLayout(BLOCKS, 16, 1, 8, [16], "float32", 0, "cpu")
    cfg = EngineConfig.from_kwargs(device="cpu", max_num_seqs=args.num_seqs, num_gpu_blocks=BLOCKS,
                                   eviction_policy="lru")
    local = CacheService(cfg.cache, shared=False)
    local.attach(layout)
    res = {"in_process": _drive(local, args.num_seqs, args.steps)}
    with tempfile.TemporaryDirectory() as d:
        address = f"unix:{d}/cache.sock"
        # (the pool's size comes with the layout; the batch limit with each plan)
        proc = subprocess.Popen([sys.executable, "-m", "nanokv.cli", "cache", "--listen", address,
                                 "--eviction-policy", "lru"], stderr=subprocess.DEVNULL)
        try:
            client = CacheClient(address, 60.0)
            client.stub.Attach(pb.AttachRequest(layout=codec.layout_to_pb(layout)))
            res["grpc"] = _drive(client, args.num_seqs, args.steps)
            client.close()
        finally:
            proc.terminate()
            proc.wait(30)
    summary = {k: {"median_ms": 1e3 * v[len(v) // 2], "p90_ms": 1e3 * v[int(0.9 * len(v))]} for k, v in res.items()}
    for k, v in summary.items():
        print(f"[plan {k}] {args.num_seqs} decoding sequences: "
              f"median {v['median_ms']:.2f} ms, p90 {v['p90_ms']:.2f} ms")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
