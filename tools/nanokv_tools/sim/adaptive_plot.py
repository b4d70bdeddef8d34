"""The docs figure: hit ratio and active eviction policy over time, adaptive vs static policies.

    python -m nanokv_tools.sim.adaptive_plot [--trace synthetic:phase_change] [--capacity 257,858] [--out FILE.png]

For each capacity: prints the block hit ratio of every static online policy and of the adaptive
run and its decisions, and draws one column of three panels - the hit ratio per window, the
cumulative hit ratio relative to LRU, and the policy the adaptive run had active. The adaptive run
is the one ``nanokv simulate --policies adaptive`` replays (starts on leaf_lru, ghosts
``simulate.ADAPTIVE_CANDIDATES``).
Torch-free; matplotlib only here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

from nanokv.cache_service.policies import ONLINE_POLICY_NAMES
from nanokv.gateway.adaptive.settings import AdaptiveSettings
from nanokv_tools.sim.adaptive_replay import Timeline, replay_adaptive
from nanokv_tools.sim.replay import keys_of
from nanokv_tools.sim.simulate import ADAPTIVE_CANDIDATES, ADAPTIVE_INITIAL
from nanokv_tools.sim.traces import TraceRequest, load_trace


def _cumulative(tl: Timeline) -> list[float]:
    return [h / t if t else 0.0 for h, t in zip(accumulate(tl.hit_blocks), accumulate(tl.total_blocks))]


def _column(axes: Any, statics: dict[str, Timeline], adaptive: Timeline, title: str, phases: Sequence[int]) -> None:
    a1, a2, a3 = axes
    base = _cumulative(statics["lru"])
    for name, tl in statics.items():
        a1.plot(tl.ends, tl.hit_ratio, label=name, linewidth=1.0, alpha=0.8)
        a2.plot(tl.ends, [100 * (c - b) for c, b in zip(_cumulative(tl), base)], label=name, linewidth=1.0)
    a1.plot(adaptive.ends, adaptive.hit_ratio, label="adaptive", color="black", linewidth=2.0)
    a2.plot(adaptive.ends, [100 * (c - b) for c, b in zip(_cumulative(adaptive), base)], label="adaptive",
            color="black", linewidth=2.0)
    names = sorted(set(adaptive.policy), key=adaptive.policy.index)
    a3.step(adaptive.ends, [names.index(p) for p in adaptive.policy], where="pre", color="black")
    a3.set_yticks(range(len(names)))
    a3.set_yticklabels(names)
    a3.set_ylim(-0.5, len(names) - 0.5)
    for ax in axes:
        for x in phases:
            ax.axvline(x, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    a1.set_title(title, fontsize=10)
    a3.set_xlabel("requests replayed")


def draw(path: str, columns: list[tuple[dict[str, Timeline], Timeline, str]], phases: Sequence[int] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(columns), figsize=(6.5 * len(columns), 7.5), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2.5, 1.2]})
    for c, (statics, adaptive, title) in enumerate(columns):
        _column(axes[:, c], statics, adaptive, title, phases)
    axes[0, 0].set_ylabel("block hit ratio (per window)")
    axes[1, 0].set_ylabel("cumulative hit ratio\nminus LRU's (points)")
    axes[2, 0].set_ylabel("adaptive: active policy")
    axes[0, 0].legend(fontsize=8, ncol=3, loc="center")  # the middle of the top panel is empty
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_capacity(reqs: list[TraceRequest], capacity: int, block_size: int, s: AdaptiveSettings,
                 drawn: Sequence[str]) -> tuple[dict[str, Timeline], Timeline]:
    keys = keys_of(reqs)
    statics: dict[str, Timeline] = {}
    ratios: dict[str, float] = {}
    for p in ONLINE_POLICY_NAMES:
        res, tl = replay_adaptive(reqs, capacity, block_size, settings=s, keys=keys, initial_policy=p, adapt=False)
        ratios[p] = res.block_hit_ratio
        if p in drawn or p == "lru":
            statics[p] = tl
    res, tl = replay_adaptive(reqs, capacity, block_size, settings=s, keys=keys, initial_policy=ADAPTIVE_INITIAL)
    best = max(ratios, key=ratios.__getitem__)
    print(f"capacity {capacity} blocks: " + ", ".join(f"{p} {r:.4f}" for p, r in
                                                         sorted(ratios.items(), key=lambda kv: -kv[1])))
    print(f"  adaptive {res.block_hit_ratio:.4f} ({100 * (res.block_hit_ratio - ratios[best]):+.2f} points vs "
          f"best static {best}, {100 * (res.block_hit_ratio - ratios['lru']):+.2f} vs lru)")
    for d in tl.decisions:
        print(f"  request {d.step}: {d.action} - {d.reason}")
    return statics, tl


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanokv_tools.sim.adaptive_plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="synthetic:phase_change")
    ap.add_argument("--capacity", default="257,858", help="comma list of pool sizes in blocks")
    ap.add_argument("--block-size-tokens", type=int, default=512)
    ap.add_argument("--window", type=int, default=AdaptiveSettings.window_steps, help="requests per window")
    ap.add_argument("--static", default="leaf_lru,lru_k,arc,s3fifo", help="static policies to draw (+ lru)")
    ap.add_argument("--out", default=None, help="PNG to write")
    args = ap.parse_args(list(argv) if argv is not None else None)
    reqs = load_trace(args.trace, args.block_size_tokens)
    s = AdaptiveSettings(window_steps=args.window, policy_candidates=ADAPTIVE_CANDIDATES)
    drawn = [p.strip() for p in args.static.split(",") if p.strip()]
    columns = []
    for cap in (int(c) for c in args.capacity.split(",")):
        statics, tl = run_capacity(reqs, cap, args.block_size_tokens, s, drawn)
        columns.append((statics, tl, f"{args.trace}: {cap} blocks, window {args.window} requests"))
    if args.out:
        n = len(reqs)
        draw(args.out, columns, [n // 3, 2 * n // 3] if args.trace == "synthetic:phase_change" else [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
