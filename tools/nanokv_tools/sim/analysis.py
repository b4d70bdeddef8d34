"""Why policies win or lose on prefix-chained traces: the measurements behind docs/cache-policies.md.

    python -m nanokv_tools.sim.analysis [--out docs]   # writes the analysis figures and prints their numbers

* ``reuse_by_class`` - the probability that a released block is requested again within a horizon, by
  what the engine knows at release: last block of the request, the one before, interior, already
  reused. Computed from the trace alone (no cache), so it is the same for every policy.
* ``reuse_times`` - for each reuse, how much new content (in blocks) arrived in between: the cache
  size that would have kept it under LRU.
* ``orphan_share`` - replaying a policy, the share of resident blocks whose parent is not resident.
  A prefix hit stops at the first missing block, so an orphan can never be hit until its parent is
  computed again: it is dead weight. LRU with tail-first release never creates one.
* ``context_sweep`` - leaf_lru / LRU at one capacity as conversations get longer (in blocks).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nanokv_tools.sim.replay import keys_of, replay, sim_manager
from nanokv_tools.sim.traces import SYNTHETIC, TraceRequest, conversation

CLASSES = ("last block", "block before the last", "interior, new", "already reused")


def _next_uses(requests: Sequence[TraceRequest]) -> list[list[int | None]]:
    nxt: list[list[int | None]] = [[None] * len(r.hash_ids) for r in requests]
    last: dict[int, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        ids = requests[i].hash_ids
        for j, h in enumerate(ids):
            nxt[i][j] = last.get(h)
        for h in ids:
            last[h] = i
    return nxt


def _new_block_clock(requests: Sequence[TraceRequest]) -> list[int]:
    """clock[i] = unique blocks seen before request i (new content is what pushes a cache)."""
    seen: set[int] = set()
    out = []
    for r in requests:
        out.append(len(seen))
        seen.update(r.hash_ids)
    out.append(len(seen))
    return out


def reuse_by_class(requests: Sequence[TraceRequest], horizon: float = 0.05) -> dict[str, tuple[int, float]]:
    """{class: (blocks released, P(requested again before ``horizon`` x unique blocks of new content))}."""
    nxt = _next_uses(requests)
    clock = _new_block_clock(requests)
    h = horizon * clock[-1]
    counts = [0, 0, 0, 0]
    reused = [0, 0, 0, 0]
    seen: set[int] = set()
    for i, r in enumerate(requests):
        n = len(r.hash_ids)
        for j, b in enumerate(r.hash_ids):
            tail = n - 1 - j
            c = 3 if b in seen else (0 if tail == 0 else 1 if tail == 1 else 2)
            counts[c] += 1
            u = nxt[i][j]
            if u is not None and clock[u] - clock[i] <= h:
                reused[c] += 1
        seen.update(r.hash_ids)
    return {name: (counts[c], reused[c] / counts[c] if counts[c] else 0.0) for c, name in enumerate(CLASSES)}


def reuse_times(requests: Sequence[TraceRequest]) -> list[float]:
    """For every block reference that reuses an earlier one, the new content in between as a
    fraction of the trace's unique blocks (sorted): the LRU cache size that keeps it."""
    clock = _new_block_clock(requests)
    last: dict[int, int] = {}
    out = []
    for i, r in enumerate(requests):
        for b in r.hash_ids:
            j = last.get(b)
            if j is not None:
                out.append((clock[i] - clock[j]) / clock[-1])
            last[b] = i
    return sorted(out)


def orphan_share(requests: Sequence[TraceRequest], policy: str, capacity: int, every: int = 16,
                 block_size: int = 512) -> float:
    """Mean share of resident blocks whose parent is not resident, sampled every ``every`` requests."""
    keys = keys_of(requests)
    parent: dict[bytes, bytes | None] = {}
    for ks in keys:
        for j, k in enumerate(ks):
            parent.setdefault(k, ks[j - 1] if j else None)
    kw: dict[str, Any] = {}
    if policy == "belady":
        from nanokv_tools.sim.replay import NextUseOracle

        oracle = NextUseOracle(keys)
        kw["oracle"] = oracle
    cm = sim_manager(capacity, block_size, policy, policy_kwargs=kw)
    shares = []
    for i, ks in enumerate(keys):
        if policy == "belady":
            oracle.now = i
        n = min(len(ks), capacity)
        if not n:
            continue
        ks = ks[:n]
        m = cm.match_prefix(range(n * block_size + 1), block_hashes=ks)
        cm.allocate(i, n * block_size, m)
        cm.cache_blocks(i, range(n * block_size), n * block_size)
        cm.free(i)
        if i % every == 0:
            index = cm.pool.index
            if index:
                orphans = sum(1 for k in index if (p := parent.get(k)) is not None and p not in index)
                shares.append(orphans / len(index))
    return sum(shares) / len(shares) if shares else 0.0


def context_sweep(pct: float = 0.05, seed: int = 0,
                  settings: Sequence[dict[str, float]] | None = None) -> list[tuple[float, float, float]]:
    """[(mean request length in blocks, share of new blocks that are a request's last block,
    leaf_lru / LRU at ``pct`` of unique blocks)] for conversations of growing length."""
    settings = settings or [
        {"system_median": 100, "personal_share": 0.0},
        {},
        {"system_median": 1000},
        {"doc_share": 0.25},
        {"doc_share": 0.25, "system_median": 1000, "personal_share": 0.5, "personal_median": 1500},
        {"doc_share": 0.6, "doc_median": 8000, "system_median": 1000},
    ]
    out = []
    for kw in settings:
        reqs = conversation(512, seed=seed, **kw)  # type: ignore[arg-type]
        keys = keys_of(reqs)
        unique = len({h for r in reqs for h in r.hash_ids})
        cap = max(1, round(pct * unique))
        lru = replay(reqs, "lru", cap, keys=keys).block_hit_ratio
        ours = replay(reqs, "leaf_lru", cap, keys=keys).block_hit_ratio
        blocks = sum(len(r.hash_ids) for r in reqs) / len(reqs)
        out.append((blocks, len(reqs) / unique, ours / lru if lru else 1.0))
    return out


def figures(out_dir: str | Path, capacity_pct: float = 0.05) -> dict[str, Any]:
    """The analysis figures of docs/cache-policies.md; returns the numbers drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    names = ("conversation", "long_conversation", "tool_agent", "shared_prompt", "rag", "mixed_phases")
    traces = {n: SYNTHETIC[n](512) for n in names}
    nums: dict[str, Any] = {"reuse": {}, "orphans": {}, "reuse_times": {}}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    # 1. reuse by class
    ax = axes[0]
    width = 0.8 / len(names)
    for k, n in enumerate(names):
        got = reuse_by_class(traces[n], capacity_pct)
        nums["reuse"][n] = got
        ax.bar([c + k * width for c in range(len(CLASSES))], [got[c][1] for c in CLASSES], width, label=n)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(CLASSES))])
    ax.set_xticklabels(CLASSES, fontsize=8)
    ax.set_ylabel(f"P(requested again within {capacity_pct:.0%} of the\ntrace's unique blocks of new content)")
    ax.set_title("a released block's future, by what is known at release", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    # 2. reuse distance CDF
    ax = axes[1]
    for n in ("conversation", "long_conversation", "tool_agent", "rag"):
        ts = reuse_times(traces[n])
        nums["reuse_times"][n] = {p: sum(1 for t in ts if t <= p) / len(ts) for p in (0.01, 0.05, 0.1, 0.25)}
        ax.plot(ts, [i / len(ts) for i in range(len(ts))], label=n)
    for p in (0.01, 0.05, 0.10, 0.25):
        ax.axvline(p, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlim(1e-4, 1)
    ax.set_xlabel("new content between two uses of a block (fraction of unique blocks)")
    ax.set_ylabel("share of reuses")
    ax.set_title("reuse distance: the LRU cache size that keeps a reuse", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    # 3. orphans
    ax = axes[2]
    conv = traces["conversation"]
    unique = len({h for r in conv for h in r.hash_ids})
    cap = round(capacity_pct * unique)
    pols = ("lru", "leaf_lru", "clock", "arc", "lru_k", "s3fifo", "sieve", "depth_lru")
    shares = [orphan_share(conv, p, cap) for p in pols]
    nums["orphans"] = dict(zip(pols, shares))
    ax.bar(pols, [100 * s for s in shares], color=["black" if p == "leaf_lru" else "C0" for p in pols])
    ax.set_ylabel("% of the cache that are orphans")
    ax.set_title(f"conversation @ {capacity_pct:.0%}: blocks whose parent was evicted", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / "cache-policies-analysis.png", dpi=110)
    plt.close(fig)
    # 4. gain vs context length
    sweep = context_sweep(capacity_pct)
    nums["context_sweep"] = sweep
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot([s[0] for s in sweep], [s[2] for s in sweep], marker="o", color="black", label="leaf_lru / LRU")
    ax.axhline(1.0, color="red", linestyle=":")
    ax.axhline(1.15, color="grey", linestyle="--", linewidth=1, label="1.15x")
    ax.set_xscale("log")
    ax.set_xticks([2, 3, 5, 10, 20])
    ax.set_xticklabels(["2", "3", "5", "10", "20"])
    ax.set_xlabel("mean request length (512-token blocks)")
    ax.set_ylabel(f"block hit ratio / LRU's at {capacity_pct:.0%}")
    ax.set_title("conversation: the shorter the chats, the more dead last blocks", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "cache-policies-context.png", dpi=110)
    plt.close(fig)
    return nums


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanokv_tools.sim.analysis", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs", help="folder for cache-policies-analysis.png, -context.png")
    ap.add_argument("--capacity", type=float, default=5.0, help="percent of unique blocks")
    args = ap.parse_args(list(argv) if argv is not None else None)
    nums = figures(args.out, args.capacity / 100)
    for n, got in nums["reuse"].items():
        print(n, "  ".join(f"{c}: {p:.3f} ({k})" for c, (k, p) in got.items()))
    for n, got in nums["reuse_times"].items():
        print(n, "reuses within", "  ".join(f"{p:.0%}: {v:.3f}" for p, v in got.items()))
    print("orphans:", "  ".join(f"{p} {100 * s:.1f}%" for p, s in nums["orphans"].items()))
    print("context sweep:", "  ".join(f"{b:.1f} blocks -> {g:.3f}x" for b, _, g in nums["context_sweep"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
