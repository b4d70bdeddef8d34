"""Formatting for ``nanokv simulate``: the hit-ratio table, the JSON record and the plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nanokv_tools.sim.replay import ReplayResult


def capacity_label(capacity: int, unique_blocks: int) -> str:
    return f"{100 * capacity / unique_blocks:.2g}% ({capacity})" if unique_blocks else str(capacity)


def format_table(
    results: Sequence[ReplayResult],
    policies: Sequence[str],
    capacities: Sequence[int],
    unique_blocks: int,
    ideal: tuple[float, float],
) -> str:
    """One row per policy, one column per capacity; cells are ``block / token`` hit ratios."""
    by = {(r.policy, r.capacity): r for r in results}
    head = ["policy"] + [capacity_label(c, unique_blocks) for c in capacities]
    rows = [head]
    for p in policies:
        row = [p]
        for c in capacities:
            r = by.get((p, c))
            row.append(f"{r.block_hit_ratio:.3f} / {r.token_hit_ratio:.3f}" if r else "-")
        rows.append(row)
    rows.append(["ideal (inf)"] + [f"{ideal[0]:.3f} / {ideal[1]:.3f}"] * len(capacities))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n(cells: block hit ratio / token hit ratio)"


def write_json(path: str | Path, meta: dict[str, Any], results: Sequence[ReplayResult]) -> None:
    doc = dict(meta)
    doc["results"] = [r.as_dict() for r in results]
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def plot(
    path: str | Path,
    results: Sequence[ReplayResult],
    policies: Sequence[str],
    capacities: Sequence[int],
    unique_blocks: int,
    ideal: tuple[float, float],
    title: str,
) -> None:
    """Block hit ratio vs capacity, one curve per policy; Belady dashed, the ideal dotted."""
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    by = {(r.policy, r.capacity): r for r in results}
    xs = [100 * c / unique_blocks for c in capacities]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in policies:
        ys = [by[(p, c)].block_hit_ratio for c in capacities if (p, c) in by]
        if len(ys) != len(xs):
            continue
        style: dict[str, Any] = {"linestyle": "--", "color": "black"} if p == "belady" else {"marker": "o"}
        ax.plot(xs, ys, label=p, linewidth=2.4 if p == "leaf_lru" else 1.3, **style)
    ax.axhline(ideal[0], linestyle=":", color="grey", label="ideal (infinite)")
    ax.set_xscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{x:.2g}%" for x in xs])
    ax.set_xlabel("cache capacity (% of the trace's unique blocks)")
    ax.set_ylabel("block hit ratio")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
