"""Simulator vs engine on one request stream (docs/cache-policies.md, "Simulator vs engine").

    python -m nanokv_tools.sim.engine_check [--conversations 40] [--blocks 24] [--block-size 8]
                                      [--policies lru,leaf_lru]

Runs a token-level multi-turn stream (``traces.chat_prompts``) through the engine on CPU with the
embedded model - one request at a time, one generated token each - and replays the same prompts
through ``replay.replay_prompts``; prints both prefix hit ratios and eviction counts per policy.
One engine serves every policy: its prefix cache and counters are reset in between, and a policy
the configuration does not list yet is switched in with the cache manager's ``set_policy``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanokv_tools.sim.engine_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--policies", default="lru,leaf_lru")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(list(argv) if argv is not None else None)

    from nanokv import LLM
    from nanokv.errors import NanoKVError
    from nanokv.sampling import SamplingParams
    from nanokv_tools.sim.replay import replay_prompts
    from nanokv_tools.sim.traces import chat_prompts

    prompts = chat_prompts(conversations=args.conversations, system_len=16, user_len=4, answer_len=6, active=3,
                           seed=args.seed)
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} tokens; pool {args.blocks} x {args.block_size}")
    llm = LLM(num_gpu_blocks=args.blocks, block_size=args.block_size, max_num_seqs=1, eviction_policy="lru",
              device="cpu")
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for policy in (p.strip() for p in args.policies.split(",")):
        llm.engine.reset_counters()  # empty prefix cache, zero counters
        try:
            llm.engine.cache_manager.set_policy(policy)
        except (AttributeError, NanoKVError) as exc:
            print(f"{policy}: cannot switch the engine to it ({exc})")
            continue
        t0 = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        s = llm.engine.stats()
        engine = s["prefix_hits_tokens"] / s["prefix_queries_tokens"]
        sim, cm = replay_prompts(prompts, policy, args.blocks, args.block_size)
        print(f"{policy}: engine {engine:.4f} ({sum(s['evictions_by_policy'].values())} evictions, "
              f"{time.perf_counter() - t0:.0f} s)  simulator {sim:.4f} ({cm.stats.evictions} evictions)  "
              f"difference {100 * (engine - sim):+.2f} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
