"""The memory-hierarchy suite: L1 alone against L1 + host memory (L2) + disk (L3), per workload.

    python -m nanokv_tools.sim.tiers_suite [--workloads mooncake,conversation,...] [--l1 1%,5%,10%]
                                           [--jobs 2] [--json OUT] [--plot OUT.png]

For each workload and L1 size (% of the trace's unique blocks) it replays: every online policy on
L1 alone (the best one is reported), Belady on L1 alone and on one cache of L1 + L2's blocks, and
the hierarchies of ``CONFIGS`` (tiered_replay.py: the engine's KVCacheManager with the lower tiers
of cache_service/tiers). L2 and L3 sizes are byte budgets in multiples of L1's bytes (L1: bf16), so
an int8 or int4 L2 holds more blocks in the same bytes. Block hit ratios; "ideal" is an infinite cache.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nanokv.cache_service.policies import ONLINE_POLICY_NAMES
from nanokv.cache_service.tiers.formats import smollm2_135m
from nanokv.errors import NanoKVError
from nanokv_tools.sim.replay import ideal, keys_of, replay
from nanokv_tools.sim.tiered_replay import TierSpec, replay_tiered
from nanokv_tools.sim.traces import MOONCAKE_TRACE, SYNTHETIC, TraceRequest, read_mooncake

WORKLOADS = ("mooncake", "conversation", "long_conversation", "multi_turn", "tool_agent", "rag")
CHAT = ("conversation", "long_conversation", "multi_turn")  # the goal's "multi-turn chat"
L1_SIZES = "1%,5%,10%"
L1_POLICIES = tuple(p for p in ONLINE_POLICY_NAMES if p != "depth_lru")  # depth_lru is retired
# name -> (L1 policy, lower tiers). L2 = 4x L1's bytes; L3 (disk) = 16x; L3 keeps a loaded block's copy.
L2, L3 = "4x", "16x"
CONFIGS: dict[str, tuple[str, tuple[TierSpec, ...]]] = {
    "L1+L2 lru": ("lru", (TierSpec("L2", L2, "lru"),)),
    "L1+L2": ("leaf_lru", (TierSpec("L2", L2, "lru"),)),
    "L1+L2 replica": ("leaf_lru", (TierSpec("L2", L2, "lru", keep_on_load=True),)),
    "L1+L2+L3": ("leaf_lru", (TierSpec("L2", L2, "lru"), TierSpec("L3", L3, "lru", keep_on_load=True))),
    "L1+L2 int8": ("leaf_lru", (TierSpec("L2", L2, "lru", "int8"),)),
    "L1+L2 int4": ("leaf_lru", (TierSpec("L2", L2, "lru", "int4"),)),
}
BLOCK_SIZE = 512

_T: dict[str, tuple[list[TraceRequest], list[list[bytes]], int]] = {}  # workload -> (requests, keys, unique)


def load(names: Sequence[str]) -> None:
    for name in names:
        if name == "mooncake":
            reqs = read_mooncake(MOONCAKE_TRACE)
        elif name in SYNTHETIC:
            reqs = SYNTHETIC[name](BLOCK_SIZE, seed=0)
        else:
            raise NanoKVError("--workloads", f"unknown {name!r}; allowed: mooncake, {', '.join(SYNTHETIC)}")
        _T[name] = (reqs, keys_of(reqs), len({h for r in reqs for h in r.hash_ids}))


def _job(job: tuple[str, str, str, int]) -> tuple[tuple[str, str, str, int], dict[str, Any]]:
    """(workload, kind, what, L1 blocks): kind "single" (what = policy; Belady also at 5x) or "tiers"."""
    workload, kind, what, c1 = job
    reqs, keys, unique = _T[workload]
    if kind == "single":
        cap = 5 * c1 if what == "belady@L1+L2" else c1
        r = replay(reqs, what.split("@")[0], cap, BLOCK_SIZE, keys=keys)
        return job, {"capacity": cap, "block_hit_ratio": r.block_hit_ratio, "token_hit_ratio": r.token_hit_ratio}
    l1_policy, specs = CONFIGS[what]
    t = replay_tiered(reqs, l1_policy, c1, specs, BLOCK_SIZE, shape=smollm2_135m(BLOCK_SIZE), keys=keys,
                      unique_blocks=unique)
    return job, t.as_dict()


def evaluate(names: Sequence[str], l1_sizes: str = L1_SIZES, workers: int = 1) -> dict[str, Any]:
    load(names)
    doc: dict[str, Any] = {}
    jobs: list[tuple[str, str, str, int]] = []
    for name in names:
        reqs, _, unique = _T[name]
        pcts = [p.strip() for p in l1_sizes.split(",") if p.strip()]
        caps = [max(1, round(float(p.rstrip("%")) / 100 * unique)) for p in pcts]
        doc[name] = {"requests": len(reqs), "unique_blocks": unique, "l1_sizes": pcts, "l1_blocks": caps,
                     "ideal": ideal(reqs, BLOCK_SIZE)[0], "single": {}, "tiers": {}}
        for c in caps:
            jobs += [(name, "single", p, c) for p in (*L1_POLICIES, "belady", "belady@L1+L2")]
            jobs += [(name, "tiers", cfg, c) for cfg in CONFIGS]
    if workers > 1:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ctx.Pool(workers) as pool:
            results = list(pool.imap_unordered(_job, jobs))
    else:
        results = [_job(j) for j in jobs]
    for (name, kind, what, c1), res in results:
        w = doc[name]
        w[kind].setdefault(what, [None] * len(w["l1_blocks"]))[w["l1_blocks"].index(c1)] = res
    for w in doc.values():
        best = []
        for i in range(len(w["l1_blocks"])):
            p = max(L1_POLICIES, key=lambda p: w["single"][p][i]["block_hit_ratio"])
            best.append({"policy": p, "block_hit_ratio": w["single"][p][i]["block_hit_ratio"]})
        w["best_single"] = best
    return doc


def _r(entry: dict[str, Any]) -> float:
    return float(entry["block_hit_ratio"])


def table(doc: dict[str, Any]) -> str:
    """The judged table: block hit ratio per workload and L1 size; (x ideal) for the hierarchies."""
    cols = ["L1 LRU", "best L1-only", "Belady L1", *CONFIGS, "Belady L1+L2", "ideal"]
    lines = ["| workload | L1 | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for name, w in doc.items():
        for i, pct in enumerate(w["l1_sizes"]):
            best = w["best_single"][i]
            cells = [f"{_r(w['single']['lru'][i]):.3f}", f"{best['block_hit_ratio']:.3f} ({best['policy']})",
                     f"{_r(w['single']['belady'][i]):.3f}"]
            cells += [f"{_r(w['tiers'][c][i]):.3f} ({_r(w['tiers'][c][i]) / w['ideal']:.2f}x)" for c in CONFIGS]
            cells += [f"{_r(w['single']['belady@L1+L2'][i]):.3f}", f"{w['ideal']:.3f}"]
            lines.append(f"| {name} | {pct} ({w['l1_blocks'][i]}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_byte_table(doc: dict[str, Any]) -> str:
    """Per L2 format at equal bytes: L2's blocks, the hit ratio, GiB of cache (L1 + L2), hit ratio per GiB."""
    lines = ["| workload | L1 | L2 format | L2 blocks | hit ratio | L2 hits | cache GiB | hit ratio / GiB |",
             "|---" * 8 + "|"]
    for name, w in doc.items():
        for i, pct in enumerate(w["l1_sizes"]):
            for cfg, fmt in (("L1+L2", "bf16"), ("L1+L2 int8", "int8"), ("L1+L2 int4", "int4")):
                e = w["tiers"][cfg][i]
                lines.append(f"| {name} | {pct} | {fmt} | {e['tiers'][0]['capacity']} | {_r(e):.3f} | "
                             f"{e['level_block_hit_ratio']['L2']:.3f} | {e['total_bytes'] / (1 << 30):.1f} | "
                             f"{e['hit_ratio_per_gib']:.4f} |")
    return "\n".join(lines)


def goal(doc: dict[str, Any]) -> list[str]:
    """'Within 5% of the infinite-cache ideal on multi-turn chat with L2 = 4x L1', per chat workload and L1 size."""
    out = []
    for name in CHAT:
        if name not in doc:
            continue
        w = doc[name]
        for i, pct in enumerate(w["l1_sizes"]):
            for cfg in ("L1+L2", "L1+L2 int4", "L1+L2+L3"):
                v = _r(w["tiers"][cfg][i])
                ok = v >= 0.95 * w["ideal"]
                out.append(f"{name} L1 {pct} {cfg}: {v:.3f} = {v / w['ideal']:.3f}x ideal {w['ideal']:.3f} "
                           f"-> {'holds' if ok else 'does NOT hold'}")
    return out


def plot(path: str | Path, doc: dict[str, Any]) -> None:
    """One panel per workload: block hit ratio against L1 size, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc)
    cols = 3
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.4 * cols, 3.8 * rows), squeeze=False)
    for k, name in enumerate(names):
        ax = axes[k // cols][k % cols]
        w = doc[name]
        xs = list(range(len(w["l1_sizes"])))
        ax.plot(xs, [_r(e) for e in w["single"]["lru"]], "o-", color="tab:red", label="L1 only, LRU")
        ax.plot(xs, [e["block_hit_ratio"] for e in w["best_single"]], "o-", color="tab:orange",
                label="L1 only, best policy")
        styles = {"L1+L2 lru": ("s--", "tab:cyan"), "L1+L2": ("s-", "tab:blue"), "L1+L2 replica": ("x:", "tab:blue"),
                  "L1+L2 int8": ("^-", "tab:purple"), "L1+L2 int4": ("v-", "tab:pink"),
                  "L1+L2+L3": ("D-", "tab:green")}
        for cfg, (marker, color) in styles.items():
            ax.plot(xs, [_r(e) for e in w["tiers"][cfg]], marker, color=color, label=cfg)
        ax.plot(xs, [_r(e) for e in w["single"]["belady"]], "--", color="grey", label="Belady, L1 only")
        ax.axhline(w["ideal"], color="black", linestyle=":", label="infinite cache")
        ax.set_xticks(xs)
        ax.set_xticklabels(w["l1_sizes"])
        ax.set_xlabel("L1 size (% of unique blocks)")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        if k % cols == 0:
            ax.set_ylabel("block hit ratio")
    for k in range(len(names), rows * cols):
        axes[k // cols][k % cols].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    fig.suptitle(f"KV hierarchy: L2 = {L2} L1's bytes (host), L3 = {L3} (disk); L1 leaf_lru, lower tiers lru "
                 "(\"L1+L2 lru\": LRU in L1)", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanokv_tools.sim.tiers_suite", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--l1", default=L1_SIZES, help="L1 sizes, %% of each trace's unique blocks")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(list(argv) if argv is not None else None)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    t0 = time.perf_counter()
    try:
        doc = evaluate(names, args.l1, max(1, args.jobs))
    except NanoKVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(doc))
    print()
    print(per_byte_table(doc))
    print()
    print("\n".join(goal(doc)))
    print(f"{time.perf_counter() - t0:.0f} s")
    if args.json_out:
        meta = {"command": "python -m nanokv_tools.sim.tiers_suite " + " ".join(argv or sys.argv[1:]),
                "block_size": BLOCK_SIZE, "kv_shape": "SmolLM2-135M (30 layers, 3 KV heads x 64)",
                "configs": {k: {"l1_policy": v[0], "tiers": [vars(s) for s in v[1]]} for k, v in CONFIGS.items()}}
        Path(args.json_out).write_text(json.dumps({**meta, "workloads": doc}, indent=1) + "\n")
    if args.plot:
        plot(args.plot, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
