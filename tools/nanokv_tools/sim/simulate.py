"""``nanokv simulate``: replay a trace through the KV cache manager for every policy x capacity.

    nanokv simulate --trace FILE|synthetic:NAME [--policies lru,clock,...] [--capacity 1%,5%,N]
                    [--block-size-tokens 512] [--json OUT] [--plot out.png]
                    [--l2 4x [--l2-format int8] [--l2-policy lru]] [--l3 16x ...]   (lower tiers)

(also ``python -m nanokv_tools.sim.simulate ...``). Each (policy, capacity) job is an independent replay
(nanokv/cache/replay.py) through the same KVCacheManager the engine uses; jobs run in a process pool.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Sequence

from nanokv.cache_service.policies import POLICY_NAMES, policy_caveat
from nanokv.config import ADAPTIVE_POLICY_CANDIDATES, ADAPTIVE_START_POLICY
from nanokv.errors import NanoKVError
from nanokv_tools.sim.replay import ReplayResult, ideal, keys_of, replay
from nanokv_tools.sim.report import format_table, plot, write_json
from nanokv_tools.sim.tiers_cli import add_tier_args, run_tiers
from nanokv_tools.sim.traces import MOONCAKE_TRACE, TraceRequest, load_trace

DEFAULT_POLICIES = ("lru", "lru_k", "clock", "arc", "s3fifo", "sieve", "depth_lru", "leaf_lru", "belady")
DEFAULT_CAPACITIES = "1%,5%,10%,25%,50%"
# Rough relative cost, to start the slow jobs first and keep both cores busy to the end.
_COST = {"adaptive": 12, "belady": 4, "lru_k": 3, "depth_lru": 2, "leaf_lru": 2, "s3fifo": 2, "arc": 2}
ADAPTIVE = "adaptive"  # not a policy: the adaptive controller switching policies (nanokv/adaptive)
# What "adaptive" replays: the engine's eviction_policy="adaptive" - the controller starting on leaf_lru
# with these ghosts (docs/cache-policies.md, "Adaptive")
ADAPTIVE_INITIAL = ADAPTIVE_START_POLICY
ADAPTIVE_CANDIDATES = tuple(ADAPTIVE_POLICY_CANDIDATES.split(","))


def parse_capacities(spec: str, unique_blocks: int) -> list[int]:
    """``"1%,5%,4096"`` -> block counts; percentages are of the trace's unique blocks."""
    out: list[int] = []
    for item in (s.strip() for s in spec.split(",")):
        try:
            if item.endswith("%"):
                frac = float(item[:-1]) / 100
                if not 0 < frac:
                    raise ValueError
                out.append(max(1, round(frac * unique_blocks)))
            else:
                n = int(item)
                if n < 1:
                    raise ValueError
                out.append(n)
        except ValueError:
            raise NanoKVError("capacity", f"{item!r} is not a positive percentage or block count") from None
    if not out:
        raise NanoKVError("capacity", "give at least one capacity")
    return sorted(set(out))


def parse_policies(spec: str) -> list[str]:
    names = [p.strip() for p in spec.split(",") if p.strip()]
    for p in names:
        if p not in POLICY_NAMES and p != ADAPTIVE:
            allowed = ", ".join((*POLICY_NAMES, ADAPTIVE))
            raise NanoKVError("policies", f"unknown policy {p!r}; allowed: {allowed}")
    if not names:
        raise NanoKVError("policies", "give at least one policy")
    return list(dict.fromkeys(names))


_W: dict[str, object] = {}  # per-worker trace, set once by the pool initializer


def _init(requests: list[TraceRequest], block_size: int, lru_k: int,
          adaptive: tuple[str, tuple[str, ...]] = (ADAPTIVE_INITIAL, ADAPTIVE_CANDIDATES)) -> None:
    _W.update(requests=requests, keys=keys_of(requests), block_size=block_size, lru_k=lru_k, adaptive=adaptive)


def _job(job: tuple[str, int]) -> ReplayResult:
    policy, capacity = job
    if policy == ADAPTIVE:  # the engine's controller, replayed (torch-free)
        from nanokv.gateway.adaptive.settings import AdaptiveSettings
        from nanokv_tools.sim.adaptive_replay import replay_adaptive
        initial: str
        candidates: tuple[str, ...]
        initial, candidates = _W["adaptive"]  # type: ignore[misc]
        return replay_adaptive(_W["requests"], capacity, _W["block_size"], lru_k=_W["lru_k"],  # type: ignore[arg-type]
                               keys=_W["keys"], initial_policy=initial,  # type: ignore[arg-type]
                               settings=AdaptiveSettings(policy_candidates=candidates))[0]
    return replay(_W["requests"], policy, capacity, _W["block_size"], lru_k=_W["lru_k"],  # type: ignore[arg-type]
                  keys=_W["keys"])  # type: ignore[arg-type]


def run(requests: list[TraceRequest], policies: Sequence[str], capacities: Sequence[int], block_size: int,
        lru_k: int = 2, workers: int | None = None, progress: bool = True,
        adaptive: tuple[str, tuple[str, ...]] = (ADAPTIVE_INITIAL, ADAPTIVE_CANDIDATES)) -> list[ReplayResult]:
    jobs = sorted(((p, c) for p in policies for c in capacities), key=lambda j: -_COST.get(j[0], 1))
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="simulate", unit="job", file=sys.stderr)
    results: list[ReplayResult] = []
    if workers == 1:
        _init(requests, block_size, lru_k, adaptive)
        for j in jobs:
            results.append(_job(j))
            if bar:
                bar.update()
    else:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ctx.Pool(workers, initializer=_init, initargs=(requests, block_size, lru_k, adaptive)) as pool:
            for r in pool.imap_unordered(_job, jobs):
                results.append(r)
                if bar:
                    bar.update()
    if bar:
        bar.close()
    order = {p: i for i, p in enumerate(policies)}
    return sorted(results, key=lambda r: (order[r.policy], r.capacity))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanokv simulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(MOONCAKE_TRACE), help="Mooncake JSONL file or synthetic:NAME "
                    "(conversation, long_conversation, tool_agent, shared_prompt, rag, multi_turn, phase_change, "
                    "mixed_phases); default: the vendored Mooncake synthetic trace")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--capacity", default=DEFAULT_CAPACITIES, help="comma list of N%% of unique blocks or N")
    ap.add_argument("--block-size-tokens", type=int, default=512)
    ap.add_argument("--lru-k", type=int, default=2, choices=(2, 3))
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (default: CPU count)")
    ap.add_argument("--adaptive-initial", default=ADAPTIVE_INITIAL, help="policy the adaptive run starts on")
    ap.add_argument("--adaptive-candidates", default=",".join(ADAPTIVE_CANDIDATES),
                    help="policies the adaptive run keeps a ghost cache for")
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--no-progress", action="store_true")
    add_tier_args(ap)
    args = ap.parse_args(list(argv) if argv is not None else None)
    try:
        if args.block_size_tokens < 1:
            raise NanoKVError("block_size_tokens", f"got {args.block_size_tokens}; must be >= 1")
        t0 = time.perf_counter()
        requests = load_trace(args.trace, args.block_size_tokens)
        unique = len({h for r in requests for h in r.hash_ids})
        total = sum(len(r.hash_ids) for r in requests)
        policies = parse_policies(args.policies)
        capacities = parse_capacities(args.capacity, unique)
        best = ideal(requests, args.block_size_tokens)
        candidates = tuple(parse_policies(args.adaptive_candidates))
        initial = parse_policies(args.adaptive_initial)[0]
        results = run(requests, policies, capacities, args.block_size_tokens, args.lru_k, args.jobs,
                      progress=not args.no_progress, adaptive=(initial, candidates))
        tiers = run_tiers(args, requests, capacities, unique, best, results) if args.l2 or args.l3 else None
        elapsed = time.perf_counter() - t0
    except NanoKVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"trace {args.trace}: {len(requests)} requests, {total} block refs, {unique} unique blocks "
          f"({args.block_size_tokens} tokens/block)")
    print(format_table(results, policies, capacities, unique, best))
    if tiers is not None:
        print(tiers[0])
    print(f"{len(results)} replays in {elapsed:.1f} s")
    caveats = [(p, policy_caveat(p)) for p in policies if policy_caveat(p)]
    if caveats:  # once each, here: replays build policies silently (sim_manager)
        print("caveats (docs/cache-policies.md):")
        for p, caveat in caveats:
            print(f"  {p}: {caveat}")
    meta = {"trace": args.trace, "requests": len(requests), "block_refs": total, "unique_blocks": unique,
            "block_size_tokens": args.block_size_tokens, "capacities": capacities, "policies": policies,
            "ideal_block_hit_ratio": best[0], "ideal_token_hit_ratio": best[1], "seconds": elapsed}
    if tiers is not None:
        meta["hierarchy"] = tiers[1]
    if args.json_out:
        write_json(args.json_out, meta, results)
    if args.plot:
        title = f"KV prefix cache hit ratio: {os.path.basename(args.trace)}"
        plot(args.plot, results, policies, capacities, unique, best, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
