"""Does greedy output stay the same when the same prompts arrive differently?

  python -m nanokv_tools.eval.invariance [--bits 16,8,4] [--prompts 6] [--max-tokens 48] [--json FILE]
      [--batch-invariant auto|on|off] [--batch-ways]

For each KV format, greedy continuations of passages of the eval corpus (1,500 characters, about
470 tokens each) are generated three ways on one engine setup: whole prompts in one step (the reference),
again on the same engine (full blocks now come from the prefix cache), and on a fresh engine that
prefills in chunks of 64 tokens. Reported per way: sequences identical to the reference, and where
each one first differs.

Why a compressed cache can differ: a compressed block is read back with its quantization error, so
any path that reads a block compressed where another read it in full precision (int4's open blocks
are attended in full precision until they fill, see docs/quality.md) changes the logits; and even
where both read the same format, float-order differences of 1e-7 can move a value across a rounding
boundary of its code, which a full-precision cache would not amplify.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from nanokv.gateway.llm import LLM
from nanokv.sampling import SamplingParams
from nanokv_tools.eval.corpus import read_corpus


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bits", default="16,8,4", help="KV formats (16 = no compression), comma list")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--corpus", default=None, help="text file (default: the eval's held-out play)")
    ap.add_argument("--batch-invariant", choices=("auto", "on", "off"), default="auto",
                    help="the engines' batch_invariant (nanokv.kernels.cpu_invariant); auto: on for "
                         "compressed caches on the CPU")
    ap.add_argument("--batch-ways", action="store_true",
                    help="also: the prompts one at a time (decode batch of 1 instead of all)")
    args = ap.parse_args(argv)
    _, text = read_corpus(args.corpus)
    n = args.prompts
    prompts = [text[len(text) * (i + 1) // (n + 1):][:1500] for i in range(n)]
    p = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    res: dict[int, dict[str, Any]] = {}
    for bits in (int(b) for b in args.bits.split(",")):
        kw: dict[str, Any] = {"enable_compression": True, "quantization_bitwidth": bits} if bits < 16 else {}
        if args.model:
            kw["model"] = args.model
        if args.batch_invariant != "auto":
            kw["batch_invariant"] = args.batch_invariant == "on"
        llm = LLM(max_num_batched_tokens=4096, **kw)
        ref = llm.generate(prompts, p, use_tqdm=False)
        ways = {"prefix_hit": llm.generate(prompts, p, use_tqdm=False),
                "chunked_64": LLM(max_num_batched_tokens=64, **kw).generate(prompts, p, use_tqdm=False)}
        if args.batch_ways:
            solo = LLM(max_num_batched_tokens=4096, **kw)
            ways["one_by_one"] = [solo.generate([x], p, use_tqdm=False)[0] for x in prompts]
        res[bits] = {}
        failed = [o.error for o in ref + [o for outs in ways.values() for o in outs] if o.error]
        if failed:  # an empty output would compare as identical
            raise SystemExit(f"invariance: a request failed: {failed[0]}")
        for way, outs in ways.items():
            diffs = [_first_diff(a.token_ids, b.token_ids) for a, b in zip(ref, outs)]
            res[bits][way] = {"identical": sum(d is None for d in diffs), "of": n, "first_difference": diffs,
                              "cached_tokens": [o.num_cached_tokens for o in outs]}
            print(f"kv {bits:2d}-bit {way:10s}: {res[bits][way]['identical']}/{n} identical; "
                  f"first difference at {diffs}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
