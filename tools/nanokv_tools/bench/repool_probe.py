"""Does a repool's bf16 output depend on what the engine served before? (python -m nanokv_tools.bench.repool_probe)

gpu_parity's repool check compares a fresh engine with a fresh one; an engine that had served the
parity runs first gave other bf16 tokens after the same repool. This probe bisects that on one
device: for each variant, a fresh engine's repool against the repool of an engine that first served
the prompts under a given history, with CUDA graphs on or off. Prints one line and a JSON row per
variant: how many of the sequences are identical and where each first diverges. Last, one more row:
a 16-bit engine repooled to int4 (the hooks rotate its values) against an int4 engine that rotates in
the hooks as well.
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


def int4_in_the_hooks(common: dict[str, Any], prompts: list[list[int]], params: Any) -> dict[str, Any]:
    """A 16-bit engine repooled to int4 (its weights carry no value rotation: the hooks rotate) against
    an int4 engine that rotates in the hooks too (no rotation folded into its weights): same tokens?"""
    from nanokv.compute_service.runner.model_runner import ModelRunner
    from nanokv.gateway.llm import LLM

    llm = LLM(**common)
    layers = len(llm.engine.model_info.layer_bits)
    llm.engine.repool(layer_bits=[4] * layers)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.shutdown()
    del llm
    fold = ModelRunner.fold_value_rotations
    ModelRunner.fold_value_rotations = lambda self: None  # type: ignore[method-assign]
    try:
        ref = LLM(**common, enable_compression=True, quantization_bitwidth=4, batch_invariant=False)
    finally:
        ModelRunner.fold_value_rotations = fold  # type: ignore[method-assign]
    want = [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    ref.engine.shutdown()
    row = {"variant": "repool to int4, values rotated in the hooks",
           "identical": f"{sum(a == b for a, b in zip(got, want))}/{len(prompts)}",
           "first_divergence": _divergence(want, got)}
    print(f"[repool probe] 16-bit engine repooled to int4 == int4 engine rotating in the hooks {row['identical']}; "
          f"first divergence {row['first_divergence']}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=10000, help="prompt token ids are drawn below this")
    ap.add_argument("--variants", default="graphs:lfl,eager:lfl,graphs:f,graphs:l",
                    help="comma list of MODE:HISTORY, MODE graphs|eager, HISTORY letters f (greedy) / l (logprobs)")
    ap.add_argument("--out", default="repool_probe.json")
    args = ap.parse_args(argv)

    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams
    from nanokv_tools.bench.gpu_parity import _generate_with_repool

    rng = random.Random(0)
    prompts = [[rng.randrange(0, args.vocab) for _ in range(rng.randint(40, 300))] for _ in range(args.num_prompts)]
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
    rows.append(int4_in_the_hooks(common, prompts, fast))
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
