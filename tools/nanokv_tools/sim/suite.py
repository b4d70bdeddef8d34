"""The policy suite: every eviction policy on every workload at 1 / 5 / 10 / 25 % capacity.

    python -m nanokv_tools.sim.suite [--workloads conversation,rag,...] [--policies lru,leaf_lru,...] [--seeds 0,1,2]
                               [--mooncake FILE] [--json OUT] [--markdown OUT] [--plot OUT.png]

Workloads are the seeded generators of ``nanokv_tools.sim.traces`` (docs/cache-policies.md, "Workloads")
plus, when ``--mooncake`` names it, the Mooncake synthetic trace. Capacities are percentages of each
trace's unique blocks. Every replay goes through ``nanokv_tools.sim.replay`` (the engine's KVCacheManager);
``adaptive`` is the engine's controller replayed (``nanokv_tools.sim.adaptive_replay``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nanokv.errors import NanoKVError
from nanokv_tools.sim.replay import ideal
from nanokv_tools.sim.simulate import ADAPTIVE, parse_capacities, parse_policies, run
from nanokv_tools.sim.traces import SYNTHETIC, TraceRequest, read_mooncake

CAPACITIES = "1%,5%,10%,25%"
POLICIES = ("lru", "clock", "lru_k", "arc", "s3fifo", "sieve", "depth_lru", "leaf_lru", "belady")
WORKLOADS = ("conversation", "long_conversation", "tool_agent", "shared_prompt", "rag", "multi_turn",
             "phase_change", "mixed_phases")


def parse_workloads(text: str) -> list[str]:
    """A ``--workloads`` comma list -> generator names; raises NanoKVError naming the flag and the allowed
    names when one is not in ``SYNTHETIC``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYNTHETIC]
    if unknown:
        raise NanoKVError("--workloads", f"unknown {unknown}; allowed: {', '.join(SYNTHETIC)}")
    return names


def load_workloads(names: Sequence[str], mooncake: str | None = None, block_size: int = 512,
                   seeds: Sequence[int] = (0,)) -> dict[str, list[TraceRequest]]:
    """Each generated workload once per seed (named `name@seed` when there are several seeds)."""
    out: dict[str, list[TraceRequest]] = {}
    for seed in seeds:
        for name in names:
            gen: Callable[..., list[TraceRequest]] = SYNTHETIC[name]
            out[name if len(seeds) == 1 else f"{name}@{seed}"] = gen(block_size, seed=seed)
    if mooncake:
        out["mooncake"] = read_mooncake(mooncake)
    return out


def evaluate(workloads: dict[str, list[TraceRequest]], policies: Sequence[str], capacities: str = CAPACITIES,
             block_size: int = 512, workers: int | None = None) -> dict[str, Any]:
    """{workload: {"capacities": [...], "unique_blocks": U, "ideal": r, "results": {policy: [ratio...]}}}"""
    doc: dict[str, Any] = {}
    for name, reqs in workloads.items():
        unique = len({h for r in reqs for h in r.hash_ids})
        caps = parse_capacities(capacities, unique)
        t0 = time.perf_counter()
        res = run(reqs, policies, caps, block_size, workers=workers, progress=False)
        by = {(r.policy, r.capacity): r for r in res}
        doc[name] = {
            "requests": len(reqs), "unique_blocks": unique, "capacities": caps,
            "ideal": ideal(reqs, block_size)[0], "seconds": time.perf_counter() - t0,
            "results": {p: [by[(p, c)].block_hit_ratio for c in caps] for p in policies},
            "token_results": {p: [by[(p, c)].token_hit_ratio for c in caps] for p in policies},
        }
    return doc


def markdown(doc: dict[str, Any], policies: Sequence[str], pcts: Sequence[str]) -> str:
    """One row per policy, one column group per workload: block hit ratio and, in brackets, x LRU."""
    lines = []
    for name, w in doc.items():
        lines.append(f"**{name}** ({w['requests']:,} requests, {w['unique_blocks']:,} unique blocks, "
                     f"ideal {w['ideal']:.3f})\n")
        lines.append("| policy | " + " | ".join(pcts) + " |")
        lines.append("|---" * (len(pcts) + 1) + "|")
        lru = w["results"].get("lru")
        for p in policies:
            cells = []
            for i, v in enumerate(w["results"][p]):
                rel = f" ({v / lru[i]:.2f}x)" if lru and lru[i] and p != "lru" else ""
                cells.append(f"{v:.3f}{rel}")
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def worst_vs_lru(doc: dict[str, Any], policy: str) -> tuple[float, str]:
    """The policy's lowest hit ratio relative to LRU over every workload and capacity, and where."""
    worst, where = float("inf"), ""
    for name, w in doc.items():
        for i, (v, ref) in enumerate(zip(w["results"][policy], w["results"]["lru"])):
            if ref > 0 and v / ref < worst:
                worst, where = v / ref, f"{name} @ {w['capacities'][i]} blocks"
    return worst, where


def plot(path: str | Path, doc: dict[str, Any], policies: Sequence[str], pcts: Sequence[str]) -> None:
    """A grid, one panel per workload: hit ratio relative to LRU vs capacity (Belady off the scale is
    clipped). The reader sees at once who is ever below 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc)
    cols = 3
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    xs = list(range(len(pcts)))
    for k, name in enumerate(names):
        ax = axes[k // cols][k % cols]
        w = doc[name]
        lru = w["results"]["lru"]
        for p in policies:
            if p == "lru":
                continue
            ys = [v / r if r else 1.0 for v, r in zip(w["results"][p], lru)]
            style: dict[str, Any] = {"marker": "o", "linewidth": 1.2}
            if p == "leaf_lru":
                style.update(linewidth=2.6, color="black")
            elif p == "belady":
                style.update(linestyle="--", color="grey", marker=None)
            ax.plot(xs, ys, label=p, **style)
        ax.axhline(1.0, color="red", linewidth=1, linestyle=":")
        ax.set_xticks(xs)
        ax.set_xticklabels(pcts)
        ax.set_ylim(0.55, 1.6)
        ax.set_title(f"{name} (LRU {' / '.join(f'{v:.2f}' for v in lru)})", fontsize=9)
        ax.grid(alpha=0.3)
        if k % cols == 0:
            ax.set_ylabel("block hit ratio / LRU's")
    for k in range(len(names), rows * cols):
        axes[k // cols][k % cols].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanokv_tools.sim.suite", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--capacity", default=CAPACITIES)
    ap.add_argument("--mooncake", default=None, help="the Mooncake synthetic trace (JSONL), if available")
    ap.add_argument("--seeds", default="0", help="generator seeds, comma list: every workload once per seed")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(list(argv) if argv is not None else None)
    try:
        names = parse_workloads(args.workloads)
    except NanoKVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    policies = parse_policies(args.policies)
    if "lru" not in policies:
        policies.insert(0, "lru")  # every ratio is relative to LRU
    pcts = [p.strip() for p in args.capacity.split(",")]
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        print(f"error: --seeds {args.seeds!r}: a comma list of integers", file=sys.stderr)
        return 2
    doc = evaluate(load_workloads(names, args.mooncake, seeds=seeds or [0]), policies, args.capacity,
                   workers=args.jobs)
    table = markdown(doc, policies, pcts)
    print(table)
    for p in policies:
        if p not in ("lru", ADAPTIVE):
            w, where = worst_vs_lru(doc, p)
            print(f"{p}: worst {w:.3f}x LRU ({where})")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"policies": policies, "capacities": pcts, "workloads": doc},
                                                  indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.plot:
        plot(args.plot, doc, policies, pcts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
