"""What a plan that demotes L2 victims to the disk tier (L3) costs on the cache service's plan thread.

    python -m nanokv_tools.bench.l3_plan_cost [--blocks 128] [--plans 12] [--json out.json]

Builds the serving tiers in this process (cache_service/tiers/serving.py) over a host segment of
Llama-3-8B-shaped blocks (32 layers x K,V of [8 heads, 16 tokens, 128] bf16: 2 MiB a slot) and a disk
tier in a temporary directory, then admits prompts of `--blocks` full blocks each: from the third
plan on, every plan moves that many blocks L1 -> L2 and as many L2 victims L2 -> L3. Prints the
median plan time and plan time per demoted block, with the same plan's time when it only moves
blocks L1 -> L2 (the second plan) for reference. No compute service: the plan's copies are not run
(they are the compute service's), and the disk writer is waited for between plans (untimed), so
the figure is the plan thread's own work. Runs against whichever nanokv is imported, so the same
command on another checkout (PYTHONPATH) compares two versions.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import tempfile
import time
from typing import Any

from nanokv.cache_service.manager import KVCacheManager
from nanokv.cache_service.storage import HostSlots, PoolStorage
from nanokv.cache_service.tiers.disk_store import DiskStore
from nanokv.cache_service.tiers.disk_tier import DiskTier
from nanokv.cache_service.tiers.formats import TierFormat
from nanokv.cache_service.tiers.serving import ServingTiers
from nanokv.messages import PoolLayout

BS = 16


def _wait_writer(disk: DiskTier) -> None:
    """Until the disk writer has written everything queued (both versions keep `_pending`)."""
    deadline = time.monotonic() + 120
    while disk._pending and time.monotonic() < deadline:  # noqa: SLF001 - a benchmark's look inside
        time.sleep(0.002)


def run(blocks: int, plans: int, layers: int, heads: int, head_dim: int, disk_dir: str) -> dict[str, Any]:
    layout = PoolLayout(num_blocks=1, block_size=BS, num_kv_heads=heads, head_dim=head_dim,
                        layer_bits=[16] * layers, dtype="bfloat16")
    staging = 8
    kw: dict[str, Any] = {}
    spare = 0
    if "spare" in inspect.signature(ServingTiers).parameters:  # this version drains slots on the writer
        spare = blocks
        kw["spare"] = spare
    storage = PoolStorage(PoolLayout(**{**layout.__dict__, "num_blocks": blocks + staging + spare}), False, 1)
    host = HostSlots(storage)
    store = DiskStore(disk_dir, (plans + 2) * blocks * (host.slot_bytes + 8192), "bench", timeout_s=None)
    disk = DiskTier(store, host.slot_bytes, 16, max_queue=max(256, 2 * blocks))
    cm = KVCacheManager(blocks + 1, BS, eviction_policy="lru")
    st = ServingTiers(cm, blocks, TierFormat("pool", 16, host.slot_bytes), disk=disk, host=host,
                      staging=staging, **kw)
    times: list[float] = []
    moved: list[int] = []
    try:
        for p in range(plans):
            ids = [p * 1_000_000 + i for i in range(blocks * BS + 1)]  # `blocks` full blocks, all new
            before = st.cache.stats.moved.get("L2->L3", 0)
            t0 = time.perf_counter()
            st.begin_plan(p)  # every earlier plan's copies done (synchronous scheduling)
            m = cm.match_prefix(ids, None)
            lm = st.begin(m)
            if cm.allocate(p, len(ids), m) is None:
                raise RuntimeError("the bench's L1 is too small for its prompt")
            st.land(lm, cm.block_table(p))
            cm.cache_blocks(p, ids, len(ids), None)
            st.finish(lm)
            st.take_copies()
            times.append(time.perf_counter() - t0)
            moved.append(st.cache.stats.moved.get("L2->L3", 0) - before)
            cm.free(p)
            _wait_writer(disk)
    finally:
        disk.close()
        store.close()
    demoting = [(t, n) for t, n in zip(times, moved) if n]
    plan_ms = statistics.median(t for t, _ in demoting) * 1e3 if demoting else float("nan")
    per_block_us = statistics.median(t / n for t, n in demoting) * 1e6 if demoting else float("nan")
    return {"slot_bytes": host.slot_bytes, "blocks_per_plan": blocks, "plans": plans,
            "drains_on_writer": bool(spare), "demoted_per_plan": [n for _, n in demoting],
            "dropped_queue_full": disk.queue_full, "plan_ms_l1_to_l2_only": times[1] * 1e3 if plans > 1 else None,
            "plan_ms_median": plan_ms, "plan_us_per_demoted_block_median": per_block_us,
            "plan_ms_all": [round(t * 1e3, 3) for t in times]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=128, help="blocks each plan demotes L2 -> L3")
    ap.add_argument("--plans", type=int, default=12)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", default="", help="also write the result here")
    a = ap.parse_args(argv)
    for name in ("blocks", "plans", "layers", "heads", "head_dim"):
        if getattr(a, name) < (3 if name == "plans" else 1):
            ap.error(f"--{name.replace('_', '-')} must be >= {3 if name == 'plans' else 1}")
    import nanokv

    with tempfile.TemporaryDirectory() as d:
        out = run(a.blocks, a.plans, a.layers, a.heads, a.head_dim, d + "/l3")
    out["nanokv"] = nanokv.__file__
    print(f"{out['slot_bytes'] / 2**20:.2f} MiB a block, {a.blocks} demoted L2->L3 per plan, "
          f"drained on the writer: {out['drains_on_writer']}")
    print(f"plan: {out['plan_ms_median']:.2f} ms median ({out['plan_us_per_demoted_block_median']:.1f} us a "
          f"demoted block); a plan moving only L1->L2: {out['plan_ms_l1_to_l2_only']:.2f} ms")
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
