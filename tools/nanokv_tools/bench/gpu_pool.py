"""The adaptive KV pool on a device: grow under a burst, shrink back when idle (python -m nanokv_tools.bench.gpu_pool).

An engine starts with a small pool and the controller on (pool rule; CUDA graphs on unless
--eager). A burst of prompts that needs several times the pool makes it grow (on CUDA into the free
device memory beyond adaptive_pool_margin_bytes); then the engine idles (Engine.tick_idle, as the
server's engine thread does) until the pool is back at its start-up size. Printed: blocks and free
device memory (torch.cuda.mem_get_info) at start, after the burst and after the idle shrink.
Checked (exit 1 on any failure): greedy outputs equal a run without the controller, both for the
burst and for the same prompts again after the shrink (prefix hits on the kept blocks); the pool
grew and came back to its start-up size; no block is left in use; on CUDA the decode graphs were
re-captured, the shrink gave memory back to the device and the start-up segment was freed once the
grow had moved every layer out of it (free_mib_after_idle against free_mib_start shows it).

fp32 by default: the check compares runs whose batches differ (the grown pool admits more at
once), and in bf16 a different batch shape may legitimately flip a near-tie.
On CPU it runs a tiny model with a byte reserve (--reserve-bytes), for testing the script itself.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from typing import Any

import torch

from nanokv_tools.bench import write_json


def free_mib(device: str) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**20


def top2_gap(logprobs: list[dict[str, Any]] | None, j: int) -> float | None:
    if not logprobs or j >= len(logprobs) or len(logprobs[j]["top"]) < 2:
        return None
    a, b = sorted(logprobs[j]["top"].values(), reverse=True)[:2]
    return float(f"{a - b:.3g}")


def block_bytes(preset: str, dtype: torch.dtype) -> int:
    """One 16-token block of full-precision K and V in every layer of a preset model."""
    from nanokv.compute_service.model.config import ModelConfig
    from nanokv.kv.cache import bytes_per_block

    mc = ModelConfig.preset(preset)
    return mc.num_hidden_layers * bytes_per_block(16, mc.num_key_value_heads, 16, mc.head_dim, dtype)


def burst(eng: Any, prompts: list[list[int]], params: Any, device: str) -> tuple[list[list[int]], int, Any, bool]:
    """Run the prompts to completion step by step. Returns the outputs in prompt order, the largest
    pool seen, the least free device memory seen (MiB; None on CPU) and whether decode graphs were
    in place at the largest pool. (The pool may already shrink in the burst's tail: the rule only
    needs two windows with little in use.)"""
    for i, ids in enumerate(prompts):
        eng.add_request(str(i), ids, params)
    outs: dict[str, list[int]] = {}
    peak, low, graphs = eng.cache_manager.num_blocks, free_mib(device), eng.runner.graphs is not None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        n = eng.cache_manager.num_blocks
        if n > peak:
            peak, low, graphs = n, free_mib(device), eng.runner.graphs is not None
    return [outs[str(i)] for i in range(len(prompts))], peak, low, graphs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="default: random:qwen3-0.6b on CUDA, random:tiny-qwen3 on CPU")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--blocks", type=int, default=64, help="start-up pool size (blocks of 16 tokens)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default: 24 on CUDA, 8 on CPU")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: 48 on CUDA, 8 on CPU")
    ap.add_argument("--window", type=int, default=4, help="adaptive_window_steps")
    ap.add_argument("--reserve-bytes", type=int, default=None,
                    help="adaptive_pool_reserve_bytes (CUDA default: none, free memory decides; CPU: 8x the pool)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    model = args.model or ("random:qwen3-0.6b" if cuda else "random:tiny-qwen3")
    n_prompts = args.num_prompts or (24 if cuda else 8)
    max_tokens = args.max_tokens or (48 if cuda else 8)

    from nanokv.gateway.adaptive.settings import PATIENCE_WINDOWS
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    rng = random.Random(0)
    lens = (100, 400) if cuda else (20, 60)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(*lens))] for _ in range(n_prompts)]
    # top-2 logprobs: on a mismatch, the reference's top-2 gap at the first differing token says
    # whether it was a near-tie (a different batch shape or attention path rounds differently)
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    common: dict[str, Any] = dict(model=model, device=args.device, dtype=args.dtype, num_gpu_blocks=args.blocks,
                                  block_size=16, max_model_len=1024, max_num_seqs=32,
                                  max_num_batched_tokens=4096 if cuda else 256, enforce_eager=args.eager)
    t0 = time.perf_counter()
    ref_llm = LLM(**common)
    ref_outs = ref_llm.generate(prompts, p, use_tqdm=False)
    ref = [o.token_ids for o in ref_outs]
    ref_preempt = ref_llm.engine.scheduler.num_preemptions
    del ref_llm
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    reserve = args.reserve_bytes
    if reserve is None and not cuda and model.startswith("random:"):  # CPU: the reserve is the budget
        reserve = 8 * args.blocks * block_bytes(model[len("random:"):], getattr(torch, args.dtype))
    llm = LLM(**common, adaptive=True, adaptive_window_steps=args.window, adaptive_pool_grow_fraction=1.0,
              adaptive_pool_reserve_bytes=reserve)
    eng = llm.engine
    if eng.controller is None or eng.controller.pool_rule is None:
        print("[pool] FAIL: the pool rule is off (see the log)")
        return 1
    res: dict[str, Any] = {"model": model, "device": args.device, "dtype": args.dtype, "base_blocks": args.blocks,
                           "reserve_bytes": reserve, "free_mib_start": free_mib(args.device)}
    got, peak_blocks, low_free, graphs_when_grown = burst(eng, prompts, p, args.device)
    res.update(peak_blocks=peak_blocks, free_mib_at_peak=low_free, graphs_when_grown=graphs_when_grown,
               blocks_after_burst=eng.stats()["kv_blocks_total"],
               # the grow moved every layer out of the start-up segment: the cache service freed it
               start_up_segment_freed=eng.local_cache.storage is None)
    ticks = 0
    while eng.cache_manager.num_blocks > args.blocks and ticks < 4 * (PATIENCE_WINDOWS + 1) * args.window:
        eng.tick_idle()
        ticks += 1
    res["idle_ticks"] = ticks
    res["blocks_after_idle"] = eng.stats()["kv_blocks_total"]
    res["graphs_after_idle"] = eng.runner.graphs is not None
    res["free_mib_after_idle"] = free_mib(args.device)
    again = [o.token_ids for o in llm.generate(prompts, p, use_tqdm=False)]  # prefix hits on the shrunk pool
    cm = eng.cache_manager
    res.update(
        identical_burst=f"{sum(a == b for a, b in zip(ref, got))}/{len(ref)}",
        identical_after_shrink=f"{sum(a == b for a, b in zip(ref, again))}/{len(ref)}",
        preemptions_without_controller=ref_preempt, adaptations=eng.stats()["adaptations"],
        decisions=[f"step {d.step}: {d.kind} {d.action} ({d.reason})" for d in eng.controller.decisions
                   if d.kind.startswith("pool")],
        graphs_at_end=eng.runner.graphs is not None, blocks_in_use_at_end=cm.num_used_blocks(),
        seconds=round(time.perf_counter() - t0, 1))
    for k, v in res.items():
        print(f"[pool] {k}: {v}")
    fails = []
    for name, outs in (("burst", got), ("after shrink", again)):
        bad = [(i, next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)) for i, (a, b) in enumerate(zip(ref, outs))
               if a != b]
        if bad:
            gaps = [top2_gap(ref_outs[i].logprobs, j) for i, j in bad]
            fails.append(f"greedy outputs differ from the run without the controller ({name}): (prompt, first "
                         f"differing token, reference top-2 logprob gap there) {[(*b, g) for b, g in zip(bad, gaps)]}")
    if peak_blocks <= args.blocks:
        fails.append("the pool did not grow during the burst")
    if res["blocks_after_idle"] != args.blocks:
        fails.append("the pool did not shrink back to its start-up size when idle")
    if cm.num_used_blocks() or cm.num_free_blocks() != cm.num_blocks:
        fails.append("blocks left in use after every request finished")
    if cuda and not args.eager and not (graphs_when_grown and res["graphs_after_idle"] and res["graphs_at_end"]):
        fails.append("CUDA graphs missing after a resize")
    if cuda and res["free_mib_after_idle"] <= low_free:
        fails.append("the shrink gave no device memory back")
    if peak_blocks > args.blocks and not res["start_up_segment_freed"]:
        fails.append("the start-up segment is still allocated beside the grown pool")
    write_json(args.out, {**res, "failures": fails}, indent=2)
    for why in fails:
        print(f"[pool] FAIL: {why}")
    print("[pool] OK" if not fails else f"[pool] {len(fails)} failure(s)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
