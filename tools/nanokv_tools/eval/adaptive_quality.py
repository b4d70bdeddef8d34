"""Perplexity of the KV bit-width rule on a layer with outlier keys (the docs/adaptive.md numbers).

    python -m nanokv_tools.eval.adaptive_quality [--layer 5] [--factor 150] [--windows 5] [--context 1024]

Layer ``--layer`` is planned int4, every other layer int8; the test hook scales that layer's key
channels by ``--factor`` (queries inversely: full-precision scores unchanged). Three caches run in
lockstep through nanokv_tools.eval's paged perplexity, each against the full-precision cache: the adaptive
one (controller with the KV-width rule only, one step per 64-token chunk), the same plan static,
and all-INT8. Windows after the first are scored together (the back-off happens in the first).
CPU, one torch thread: ~4 min for the defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch

from nanokv.compute_service import kv_hooks as hooks
from nanokv.compute_service.adaptive.precision import PrecisionActuator
from nanokv.config import parse_bitwidth
from nanokv.gateway.adaptive.controller import AdaptiveController
from nanokv.gateway.adaptive.settings import AdaptiveSettings
from nanokv_tools.eval.corpus import read_corpus
from nanokv_tools.eval.metrics import Comparison
from nanokv_tools.eval.perplexity import run_perplexity
from nanokv_tools.eval.runners import build
from nanokv_tools.eval.settings import Setting, preset


def _merge(into: Comparison, c: Comparison) -> None:
    into.nll_sum += c.nll_sum
    into.ref_nll_sum += c.ref_nll_sum
    into.top1_agree += c.top1_agree
    into.n += c.n
    into.kl += c.kl


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanokv_tools.eval.adaptive_quality",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer", type=int, default=5)
    ap.add_argument("--factor", type=float, default=150.0)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--window-steps", type=int, default=4)
    ap.add_argument("--corpus", default=None)
    args = ap.parse_args(list(argv) if argv is not None else None)
    torch.set_num_threads(1)  # two threads on a shared 2-core box spin-wait each other
    plan = parse_bitwidth({"default": 8, "layers": {str(args.layer): 4}})
    blocks = -(-args.context // 16) + 8
    bench = build([Setting("adaptive", plan), Setting("static", plan), preset("int8")], None, blocks, 16,
                  max(2048, args.context))
    act = PrecisionActuator(bench.runners["adaptive"])
    ctl = AdaptiveController(AdaptiveSettings(window_steps=args.window_steps), precision=act)
    _, text = read_corpus(args.corpus)
    toks = bench.engine.tokenizer(text)["input_ids"]
    c = args.context

    def step(_: int) -> None:  # one controller step per scored chunk
        ctl.on_step()

    after = {n: Comparison() for n in bench.runners}
    with hooks.key_outliers(args.layer, args.factor):
        for i in range(args.windows):
            res = run_perplexity(bench, [toks[i * c:(i + 1) * c]], 64, progress=step)
            row = {n: round(r.summary()["delta_ppl_pct"], 3) for n, r in res.items()}
            print(f"window {i}: delta PPL % {row}, layer {args.layer} at {act.current_bits()[args.layer]} bits",
                  flush=True)
            if i:
                for n, r in res.items():
                    _merge(after[n], r)
    for d in ctl.decisions:
        print(f"step {d.step}: {d.action} ({d.reason})")
    print(json.dumps({n: r.summary() for n, r in after.items() if r.n}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
