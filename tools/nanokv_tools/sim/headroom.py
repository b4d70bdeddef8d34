"""Where a workload's hits above LRU are, and which of them an online policy can reach.

    python -m nanokv_tools.sim.headroom [--workloads conversation,long_conversation] [--seeds 0,1,2,3,4]
                                  [--capacity 5%] [--json OUT] [--plot OUT.png]

Besides LRU, leaf_lru and Belady it replays two oracles and three probes (simulator-only policies, not
in the registry, ``nanokv_tools.sim.headroom_policies`` and ``turn_probe``; docs/cache-policies.md, "The headroom"):

* ``dead_leaf_oracle`` - LRU plus a cold FIFO, evicted first, for every sequence's *last* block that
  is never requested again: what leaf_lru learns, known exactly.
* ``ended_oracle`` - the same for *every* block never requested again: the conversations that
  ended, which nothing in the request stream announces.
* ``probe_reused`` - leaf_lru whose reused blocks age ``w`` times slower (frequency and turn-count
  protection: a conversation that came back before is kept longer).
* ``probe_idle_gap`` - leaf_lru plus end prediction from a block's own inter-reference gap: a block
  idle for more than ``k`` times its last gap is taken to have ended and goes first (LIRS-like).
* ``probe_turn`` - leaf_lru plus end prediction from a conversation's turn count, learned per turn
  (``nanokv_tools.sim.turn_probe``): what an end rate that rises with the turn count would offer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nanokv.cache_service.policies.base import EvictionPolicy
from nanokv.errors import NanoKVError
from nanokv_tools.sim.headroom_policies import DeadOracle, EvictionAges, IdleGapEnd, NextUse, ReusedAgesSlower
from nanokv_tools.sim.replay import keys_of, replay
from nanokv_tools.sim.simulate import parse_capacities
from nanokv_tools.sim.suite import parse_workloads
from nanokv_tools.sim.traces import SYNTHETIC
from nanokv_tools.sim.turn_probe import TurnEndProbe

BUILDERS: dict[str, Callable[[int, NextUse], EvictionPolicy]] = {
    "dead_leaf_oracle": lambda cap, nu: DeadOracle(cap, nu, leaves_only=True),
    "probe_reused": lambda cap, _nu: ReusedAgesSlower(cap, w=2.0),
    "probe_idle_gap": lambda cap, _nu: IdleGapEnd(cap, k=8.0),
    "probe_turn": lambda cap, _nu: TurnEndProbe(cap),
    "ended_oracle": lambda cap, nu: DeadOracle(cap, nu, leaves_only=False),
}
COLUMNS = ("leaf_lru", "dead_leaf_oracle", "probe_reused", "probe_idle_gap", "probe_turn", "ended_oracle",
           "belady")


def headroom(reqs: Sequence[Any], capacity: int) -> dict[str, Any]:
    """Block hits of LRU and of every column at one capacity, plus leaf_lru's median eviction age in
    seconds (the time an idle conversation stays cached)."""
    keys = keys_of(reqs)
    hits = {p: replay(reqs, p, capacity, keys=keys).block_hits for p in ("lru", "leaf_lru", "belady")}
    for name, build in BUILDERS.items():
        hits[name] = replay(reqs, name, capacity, keys=keys, build=build).block_hits
    probe: list[EvictionAges] = []

    def aged(cap: int, _nu: NextUse) -> EvictionPolicy:
        probe.append(EvictionAges(cap))
        return probe[0]

    replay(reqs, "leaf_lru", capacity, keys=keys, build=aged)
    seconds_per_release = (reqs[-1].timestamp - reqs[0].timestamp) / 1000.0 / max(1, probe[0]._now)
    age = statistics.median(probe[0].ages) * seconds_per_release if probe[0].ages else 0.0
    total = sum(len(r.hash_ids) for r in reqs)
    return {"capacity": capacity, "blocks": total, "hits": hits, "eviction_age_s": age}


def plot(path: str | Path, out: dict[str, Any]) -> None:
    """One group of bars per trace: every column's hits relative to LRU's, with the 1.15x target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(names)), 4.2))
    width = 0.8 / len(COLUMNS)
    for k, col in enumerate(COLUMNS):
        ys = [out[n]["hits"][col] / out[n]["hits"]["lru"] for n in names]
        ax.bar([i + (k - len(COLUMNS) / 2 + 0.5) * width for i in range(len(names))], ys, width, label=col)
    ax.axhline(1.0, color="red", linewidth=1, linestyle=":")
    ax.axhline(1.15, color="black", linewidth=1, linestyle="--", label="1.15x target")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0.9, max(1.7, ax.get_ylim()[1]))
    ax.set_ylabel("block hits / LRU's")
    ax.legend(fontsize=7, ncol=4, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanokv_tools.sim.headroom", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="conversation,long_conversation")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--capacity", default="5%", help="one capacity: a percentage of unique blocks or a count")
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(list(argv) if argv is not None else None)
    try:
        names = parse_workloads(args.workloads)
    except NanoKVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        print(f"error: --seeds {args.seeds!r}: a comma list of integers", file=sys.stderr)
        return 2
    print("| trace | LRU | " + " | ".join(COLUMNS) + " | idle conversation kept |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    out: dict[str, Any] = {}
    for name in names:
        for seed in seeds:
            reqs = SYNTHETIC[name](512, seed=seed)
            cap = parse_capacities(args.capacity, len({h for r in reqs for h in r.hash_ids}))[0]
            row = out[f"{name}@{seed}"] = headroom(reqs, cap)
            lru = row["hits"]["lru"]
            cells = " | ".join(f"{row['hits'][c] / lru:.3f}" for c in COLUMNS)
            print(f"| {name}@{seed} | {lru / row['blocks']:.3f} | {cells} | {row['eviction_age_s']:.0f} s |",
                  flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1) + "\n")
    if args.plot:
        plot(args.plot, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
