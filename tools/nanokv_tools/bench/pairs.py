"""A compressed cache against bf16, side by side: `python -m nanokv_tools.bench.pairs --bits 4 --pairs 3`.

The compressed caches' decode targets (int8 1.5x, int4 2x bf16) are ratios of two whole benchmark
runs (`nanokv bench --workload longctx` with and without `--enable-compression
--quantization-bitwidth B`), and one pair's ratio moves by about +-0.01 from pair to pair
(docs/benchmarks.md). This runs the pairs back to back,
each run in its own process as a user would, the order alternating (bf16 first in even pairs), and
prints every pair's ratio, their range and the ratio of the means; JSON with --out. "bf16" is the
uncompressed cache in the model's dtype (bf16 on a GPU, fp32 on the CPU workload).
Arguments after `--` go to every run (e.g. `-- --quick`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from statistics import mean

from nanokv_tools.bench import write_json


def _tok_s(result: dict) -> float:
    """tok/s of nanokv in a bench JSON (GPU workloads at the top level, the CPU one under "nanokv")."""
    return float(result["output_tokens_per_s"] if "output_tokens_per_s" in result
                 else result["nanokv"]["output_tokens_per_s"])


def _run(argv: list[str], out: str) -> float:
    cmd = [sys.executable, "-m", "nanokv.cli", "bench", *argv, "--out", out]
    print("$", " ".join(cmd[1:]), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    with open(out) as f:
        return _tok_s(json.load(f))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, default=4, choices=(8, 4))
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--workload", default="longctx")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--out", default=None, help="JSON file")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.pairs < 1:
        raise SystemExit("--pairs must be at least 1")
    base = ["--workload", args.workload, "--max-num-batched-tokens", str(args.max_num_batched_tokens), *extra]
    quant = [*base, "--enable-compression", "--quantization-bitwidth", str(args.bits)]
    runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            order = [("bf16", base), ("quant", quant)]
            pair: dict[str, float] = {}
            for name, a in order if i % 2 == 0 else order[::-1]:
                pair[name] = _run(a, os.path.join(tmp, f"{i}_{name}.json"))
                print(f"  pair {i} {name}: {pair[name]:,.0f} tok/s", flush=True)
            pair["ratio"] = pair["quant"] / pair["bf16"]
            runs.append(pair)
    ratios = [p["ratio"] for p in runs]
    res = {"bits": args.bits, "workload": args.workload, "pairs": runs, "ratio_min": min(ratios),
           "ratio_max": max(ratios), "ratio_of_means": mean(p["quant"] for p in runs) / mean(p["bf16"] for p in runs),
           "bf16_mean": mean(p["bf16"] for p in runs), "quant_mean": mean(p["quant"] for p in runs),
           "extra_args": extra}
    print(f"int{args.bits} / bf16 over {len(runs)} pairs: " + " ".join(f"{r:.3f}" for r in ratios)
          + f"; range {res['ratio_min']:.3f}-{res['ratio_max']:.3f}; means {res['quant_mean']:,.0f} / "
          f"{res['bf16_mean']:,.0f} = {res['ratio_of_means']:.3f}")
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
