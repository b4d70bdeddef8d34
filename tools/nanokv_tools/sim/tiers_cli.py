"""``nanokv simulate``'s lower tiers: ``--l2 4x --l2-format int8 --l3 16x ...`` (docs/hierarchy.md).

With ``--l2`` or ``--l3`` the simulator also replays, at every L1 capacity, the hierarchy of L1 (the
same KVCacheManager) and the lower tiers (cache_service/tiers), and prints the hit ratio per tier
next to the single-tier table it already prints (every policy on L1 alone, ideal, Belady).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from nanokv.cache_service.tiers.formats import FORMAT_BITS, KVShape
from nanokv.errors import NanoKVError
from nanokv_tools.sim.replay import ReplayResult, keys_of
from nanokv_tools.sim.report import capacity_label
from nanokv_tools.sim.tiered_replay import GIB, TieredResult, TierSpec, replay_tiered
from nanokv_tools.sim.traces import TraceRequest

_SIZE_HELP = "Nx (times L1's bytes), N%% (of the trace's unique blocks, in L1's format), N GiB/MiB, or N blocks"


def add_tier_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("lower tiers (docs/hierarchy.md)")
    formats = tuple(FORMAT_BITS)
    for tier, where in (("l2", "host memory"), ("l3", "disk")):
        g.add_argument(f"--{tier}", default=None, help=f"{tier.upper()} ({where}) byte budget: {_SIZE_HELP}")
        g.add_argument(f"--{tier}-policy", default="lru", help=f"{tier.upper()}'s eviction policy")
        g.add_argument(f"--{tier}-format", default="bf16", choices=formats, help=f"{tier.upper()}'s storage format")
    g.add_argument("--keep-on-load", default="L3", help="lower tiers that keep a block's copy after loading it "
                   "into L1 (comma list of L2, L3; empty: none)")
    g.add_argument("--tier-l1-policies", default="lru,leaf_lru", help="L1 policies of the tiered replays")
    g.add_argument("--kv-shape", default="30,3,64", help="LAYERS,KV_HEADS,HEAD_DIM for the byte counts "
                   "(default: SmolLM2-135M)")


def tier_specs(args: argparse.Namespace) -> list[TierSpec]:
    keep = {t.strip().upper() for t in args.keep_on_load.split(",") if t.strip()}
    if not keep <= {"L2", "L3"}:
        raise NanoKVError("keep_on_load", f"got {args.keep_on_load!r}; allowed: L2, L3")
    specs = []
    for name in ("L2", "L3"):
        size = getattr(args, name.lower())
        if size:
            specs.append(TierSpec(name, size, getattr(args, f"{name.lower()}_policy"),
                                  getattr(args, f"{name.lower()}_format"), name in keep))
    return specs


def kv_shape(text: str, block_size: int) -> KVShape:
    try:
        layers, heads, dim = (int(x) for x in text.split(","))
        if min(layers, heads, dim) < 1:
            raise ValueError
    except ValueError:
        raise NanoKVError("kv_shape", f"got {text!r}; give LAYERS,KV_HEADS,HEAD_DIM (positive integers)") from None
    return KVShape(layers, heads, dim, block_size)


def run_tiers(args: argparse.Namespace, requests: list[TraceRequest], capacities: Sequence[int], unique: int,
              ideal: tuple[float, float], single: Sequence[ReplayResult]) -> tuple[str, list[dict[str, Any]]]:
    """The tiered replays (one per L1 policy x capacity): the table and the JSON records."""
    specs = tier_specs(args)
    shape = kv_shape(args.kv_shape, args.block_size_tokens)
    keys = keys_of(requests)
    l1_policies = [p.strip() for p in args.tier_l1_policies.split(",") if p.strip()]
    results: list[TieredResult] = [
        replay_tiered(requests, p, c, specs, args.block_size_tokens, shape=shape, keys=keys, unique_blocks=unique)
        for p in l1_policies for c in capacities]
    by = {(r.policy, r.capacity): r.block_hit_ratio for r in single}
    names = ["L1"] + [s.name for s in specs]
    desc = ", ".join(f"{s.name} {s.budget} {s.format} {s.policy}{' (keeps loads)' if s.keep_on_load else ''}"
                     for s in specs)
    head = ["L1 policy", "L1", *(f"{n} hits" for n in names), "total", "x ideal", "L1 alone", "Belady L1",
            "GiB", "hit ratio/GiB"]
    rows = [head]
    for r in results:
        lv = r.level_ratios()
        alone, bel = by.get((r.l1_policy, r.l1_capacity)), by.get(("belady", r.l1_capacity))
        rows.append([r.l1_policy, capacity_label(r.l1_capacity, unique), *(f"{lv[n]:.3f}" for n in names),
                     f"{r.block_hit_ratio:.3f}", f"{r.block_hit_ratio / ideal[0]:.2f}" if ideal[0] else "-",
                     f"{alone:.3f}" if alone is not None else "-", f"{bel:.3f}" if bel is not None else "-",
                     f"{r.total_bytes / GIB:.1f}", f"{r.hits_per_gib:.4f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    text = (f"hierarchy: {desc}; block hit ratio per tier (ideal {ideal[0]:.3f})\n" + "\n".join(lines))
    return text, [r.as_dict() for r in results]
