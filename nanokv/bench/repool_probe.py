"""Does a repool's bf16 output depend on what the engine served before? (python -m nanokv.bench.repool_probe)

gpu_parity's repool check compares a fresh engine with a fresh one; an engine that had served the
parity runs first gave other bf16 tokens after the same repool. This probe bisects that on one
device: for each variant, a fresh engine's repool against the repool of an engine that first served
the prompts under a given history, with CUDA graphs on or off. Prints one line and a JSON row per
variant: how many of the sequences are identical and where each first diverges.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any


def _history(llm: Any, prompts: list[list[int]], names: str) -> None:
    """Serve the prompts once per letter: f = greedy, l = greedy with logprobs."""
    from nanokv.sampling import SamplingParams

    for name in names:
        p = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1 if name == "l" else None)
        llm.generate(prompts, p, use_tqdm=False)


def _divergence(a: list[list[int]], b: list[list[int]]) -> list[int]:
    return [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), len(u)) for u, v in zip(a, b)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--variants", default="graphs:lfl,eager:lfl,graphs:f,graphs:l",
                    help="comma list of MODE:HISTORY, MODE graphs|eager, HISTORY letters f (greedy) / l (logprobs)")
    ap.add_argument("--out", default="repool_probe.json")
    args = ap.parse_args(argv)

    from nanokv.bench.gpu_parity import _generate_with_repool
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(0, 10000) for _ in range(rng.randint(40, 300))] for _ in range(args.num_prompts)]
    fast = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    common: dict = dict(model=args.model, max_model_len=1024, num_gpu_blocks=256, block_size=16,
                        device=args.device, dtype=args.dtype)
    fresh: dict[str, list[list[int]]] = {}
    rows = []
    for variant in args.variants.split(","):
        mode, history = variant.split(":")
        kw = common | {"enforce_eager": mode == "eager"}
        if mode not in fresh:
            llm = LLM(**kw)
            fresh[mode], _ = _generate_with_repool(llm.engine, prompts, fast)
            llm.engine.shutdown()
            del llm
        llm = LLM(**kw)
        _history(llm, prompts, history)
        got, _ = _generate_with_repool(llm.engine, prompts, fast)
        llm.engine.shutdown()
        del llm
        same = sum(a == b for a, b in zip(got, fresh[mode]))
        row = {"variant": variant, "identical": f"{same}/{len(prompts)}",
               "first_divergence": _divergence(fresh[mode], got)}
        rows.append(row)
        print(f"[repool probe] {variant}: served '{history}' first, then repooled == a fresh engine's repool "
              f"{row['identical']}; first divergence {row['first_divergence']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
