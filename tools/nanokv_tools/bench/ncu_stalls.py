"""Summarize an Nsight Compute source-page export: warp-stall reasons and the executed instruction mix.

  ncu --import X.ncu-rep --page source --csv --print-source sass > X.csv
  python -m nanokv_tools.bench.ncu_stalls X.csv [--loop-count N]

--loop-count N: also list the opcodes of the instructions executed exactly N times (e.g. the number
of (program, tile) iterations of a kernel's main loop), per iteration.
--top N: also list the N instructions with the most stall samples, with their two main reasons.
"""

from __future__ import annotations

import argparse
import collections
import csv


def _num(x: str) -> int:
    return int(x) if x not in ("", "-") else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--loop-count", type=int, default=0)
    ap.add_argument("--top", type=int, default=0)
    args = ap.parse_args(argv)
    with open(args.csv) as f:
        rows = list(csv.reader(f))
    hdr = rows[1]
    ix = {h: i for i, h in enumerate(hdr)}
    data = [r for r in rows[2:] if len(r) >= len(hdr)]
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    stalls = collections.Counter({h: sum(_num(r[ix[h]]) for r in data) for h in stall_cols})
    total = sum(stalls.values()) or 1
    print(f"{rows[0][1]}: {total} stall samples")
    for name, v in stalls.most_common(10):
        print(f"  {name:24s} {100 * v / total:5.1f}%")
    ops: collections.Counter[str] = collections.Counter()
    loop: collections.Counter[str] = collections.Counter()
    for r in data:
        words = r[ix["Source"]].split()
        if not words:
            continue
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        n = _num(r[ix["Instructions Executed"]])
        ops[op.split(".")[0]] += n
        if args.loop_count and n == args.loop_count:
            loop[op] += 1
    executed = sum(ops.values()) or 1
    print(f"executed warp instructions: {executed}")
    for name, v in ops.most_common(12):
        print(f"  {name:10s} {100 * v / executed:5.1f}%")
    if loop:
        print(f"main loop: {sum(loop.values())} instructions per iteration")
        print("  " + ", ".join(f"{k} {v}" for k, v in loop.most_common(16)))
    if args.top:
        per = sorted(data, key=lambda r: -sum(_num(r[ix[h]]) for h in stall_cols))[:args.top]
        print(f"top {args.top} instructions by stall samples (share of all; main reasons):")
        for r in per:
            c = collections.Counter({h[6:]: _num(r[ix[h]]) for h in stall_cols})
            why = ", ".join(f"{k} {v}" for k, v in c.most_common(2) if v)
            n = _num(r[ix["Instructions Executed"]])
            print(f"  {100 * sum(c.values()) / total:5.1f}%  x{n:<9d} {r[ix['Source']].strip()[:64]:64s} {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
