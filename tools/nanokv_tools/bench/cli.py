"""`nanokv bench`: pick a workload, run nanokv (and the peer in the same run), print, write JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from typing import Any

WORKLOADS = ("cpu", "cpu-stream", "nanovllm", "longctx", "kernels")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=WORKLOADS, default=None,
                   help="cpu: seeded batch on the embedded model; cpu-stream: one stream's decode on the CPU "
                        "(docs/cpu-decode.md); nanovllm / longctx: GPU, random Qwen3-0.6B")
    p.add_argument("--compare", choices=("hf", "llama.cpp", "none"), default=None,
                   help="run the same workload through HF transformers (cpu, GPU workloads) or llama.cpp "
                        "(cpu-stream: llama-cpp-python, the tools[cpu-peer] extra) in the same run")
    p.add_argument("--num-seqs", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON output path")
    p.add_argument("--quick", action="store_true", help="smaller workload (smoke test)")
    p.add_argument("--transport", choices=("in-process", "split", "both"), default="in-process",
                   help="GPU workloads: services in this process, or cache + compute as processes over gRPC "
                        "(the pool shared by CUDA IPC), or both side by side in this run")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def run_bench(args: argparse.Namespace, engine_kw: dict[str, Any]) -> int:
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    workload = args.workload or ("cpu" if engine_kw.get("device", "cpu") == "cpu" else "nanovllm")
    if workload == "cpu-stream":
        from nanokv_tools.bench.cpu_stream import run_cpu_stream_bench
        result = run_cpu_stream_bench(engine_kw, compare=args.compare == "llama.cpp", quick=args.quick)
    elif workload == "cpu":
        from nanokv_tools.bench.cpu import run_cpu_bench
        result = run_cpu_bench(engine_kw, compare=args.compare != "none", quick=args.quick,
                               num_seqs=args.num_seqs)
    elif workload in ("nanovllm", "longctx"):
        from nanokv_tools.bench.gpu import run_gpu_bench
        result = run_gpu_bench(workload, engine_kw, compare=args.compare == "hf", quick=args.quick,
                               num_seqs=args.num_seqs, transport=args.transport)
    else:
        from nanokv_tools.bench.gpu_kernels import main as kernels_main
        return int(kernels_main(["--out", args.out or "."]) or 0)
    result.update(date=time.strftime("%Y-%m-%d"), commit=_commit(), host=platform.node(),
                  cpu_count=os.cpu_count())
    out = args.out or f"bench_{workload}.json"
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")
    return 0


def main(argv: list[str]) -> int:
    """`nanokv bench ...` (an entry point of group nanokv.commands): the bench flags and the engine's;
    `nanokv bench serve ...` is the online serving benchmark, with flags of its own."""
    if argv and argv[0] == "serve":
        from nanokv_tools.bench.serve import main as serve_main
        return serve_main(argv[1:])
    from nanokv.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser(prog="nanokv bench", description="throughput benchmarks (prints numbers, writes JSON); "
                                "`nanokv bench serve --help`: the online serving benchmark")
    add_bench_args(p)
    add_engine_args(p)
    args = p.parse_args(argv)
    return run_bench(args, engine_kwargs(args))


if __name__ == "__main__":  # `python -m nanokv_tools.bench.cli` where the entry points are not installed
    import sys

    sys.exit(main(sys.argv[1:]))
