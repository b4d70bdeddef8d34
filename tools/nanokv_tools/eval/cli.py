"""`nanokv eval`: quality of a KV compression setting against the full-precision cache.

    nanokv eval --quantization-bitwidth 4 [--layer-bits '{"0": 8, "-1": 8}'] [--rotation auto|on|off]
                [--tokens 8192 --context 2048 --chunk 64] [--passkey-lengths 512,1024,2048]
                [--corpus FILE] [--model PATH] [--json OUT]
    nanokv eval --setting int8 --setting int4 ...      (named presets, all in one lockstep run)
    nanokv eval --lower-tier-format int8,int4   (a full-precision cache whose full blocks are served from
                                               an int8 / int4 lower tier: each round-trips once it fills)
    nanokv eval --compression-sparsity 0.25,0.5,0.75 --sparsity-policy streaming,attention,hybrid
                (block sparsity on top of each setting: every (policy, s) pair, plus the dense setting)

Prints a table last (bytes/token vs bf16, PPL, dPPL %, KL mean / p99.9, top-1, passkey) and
writes everything (including per-layer compression error and passkey samples) to --json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from typing import Any

from nanokv.config import SPARSITY_POLICIES
from nanokv.errors import NanoKVError
from nanokv.sparsity import SparsityParams, budget_help, full_rate_blocks
from nanokv_tools.eval import corpus, settings
from nanokv_tools.eval.passkey import MAX_NEW


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanokv eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=None, help="UTF-8 text file (default: a held-out Shakespeare play)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens scored for perplexity (0: skip)")
    p.add_argument("--context", type=int, default=2048, help="window length in tokens")
    p.add_argument("--chunk", type=int, default=64, help="tokens fed per step (each reads the cache)")
    p.add_argument("--quantization-bitwidth", default="8", help="8, 4 (or 16: the reference vs itself)")
    p.add_argument("--layer-bits", default=None, help='per-layer plan, e.g. \'{"0": 8, "-1": 8}\'')
    p.add_argument("--rotation", default="auto", help="Hadamard key rotation: auto (format default), on, off")
    p.add_argument("--setting", action="append", default=[],
                   help=f"named preset, repeatable: {', '.join(settings.PRESETS)}")
    p.add_argument("--lower-tier-format", default="",
                   help="comma list of int8, int4: also score a full-precision cache whose full blocks come "
                        "from a lower tier of that format (round-tripped once they fill; docs/quality.md)")
    p.add_argument("--compression-sparsity", default="0",
                   help="a comma list of s in [0, 1) runs each. " + budget_help(16)
                        + f"; {32 * full_rate_blocks(SparsityParams(0.5)):,} tokens at this tool's default "
                          "--block-size 32")
    p.add_argument("--sparsity-policy", default="streaming",
                   help=f"comma list of: {', '.join(SPARSITY_POLICIES)}")
    p.add_argument("--sparsity-sinks", type=int, default=None, help="first blocks always kept (default 4)")
    p.add_argument("--sparsity-recent", type=int, default=None, help="last full blocks always kept (default 32)")
    p.add_argument("--sparsity-min-ranked", type=int, default=None,
                   help="blocks the policy ranks that are kept whatever the budget (default 8)")
    p.add_argument("--sparsity-score", default=None,
                   help="attention/hybrid: per-block attention mass accumulates by max (default) or sum")
    p.add_argument("--sparsity-probe-window", type=int, default=None,
                   help="attention/hybrid: score only each row's last W queries (0 = all; default: "
                        "sparsity_options' default, 32)")
    p.add_argument("--passkey-lengths", default="512,1024,2048",
                   help="comma list of prompt lengths ('' = skip)")
    p.add_argument("--passkey-trials", type=int, default=10, help="prompts per length")
    p.add_argument("--passkey-prefill", default="whole", choices=("whole", "chunked"),
                   help="sparse settings: prefill the prompt in one step (the engine's default for prompts "
                        "within max_num_batched_tokens), or in --chunk chunks, sparsifying after each")
    p.add_argument("--json", default=None, help="write the full result here")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    p.add_argument("--block-size", type=int, default=32,
                   help="tokens per KV block (int4 keys carry a scale and zero per channel per block: "
                        "29.7%% of bf16 at 32, 32.8%% at 16)")
    p.add_argument("--batch-invariant", default="off", choices=("off", "on"),
                   help="every setting (the fp reference too) on the batch-invariant CPU path "
                        "(nanokv.kernels.cpu_invariant; int4 then reads blocks by its one rule)")
    p.add_argument("--weight-quantization", default="none", choices=("none", "gguf"),
                   help="the model's weights: none (dequantized to fp32) or gguf (4-bit GGUF matrices kept "
                        "packed, docs/cpu-decode.md); every setting runs on them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1 is fastest on a shared box: more threads spin-wait)")
    p.add_argument("--no-progress", action="store_true")
    return p


def _check(args: argparse.Namespace) -> list[int]:
    for name, lo in (("tokens", 0), ("context", 2), ("chunk", 1), ("passkey_trials", 1)):
        v = getattr(args, name)
        if v < lo:
            raise NanoKVError(name, f"got {v}; must be >= {lo}")
    if args.chunk > args.context:
        raise NanoKVError("chunk", f"got {args.chunk}; must be <= --context ({args.context})")
    sparsity_variants(args)  # validates the sparsity flags
    try:
        lengths = [int(x) for x in args.passkey_lengths.split(",") if x.strip()]
    except ValueError:
        raise NanoKVError("passkey_lengths",
                          f"got {args.passkey_lengths!r}; want e.g. 512,1024,2048") from None
    if any(L < 64 for L in lengths):
        raise NanoKVError("passkey_lengths", "each length must be >= 64 tokens")
    return lengths


def sparsity_variants(args: argparse.Namespace) -> list[SparsityParams]:
    """Every (policy, s > 0) pair the flags ask for, in flag order."""
    policies = [x.strip() for x in args.sparsity_policy.split(",") if x.strip()]
    for pol in policies:
        if pol not in SPARSITY_POLICIES:
            raise NanoKVError("sparsity_policy", f"got {pol!r}; allowed: {', '.join(SPARSITY_POLICIES)}")
    try:
        values = [float(x) for x in str(args.compression_sparsity).split(",") if x.strip()]
    except ValueError:
        raise NanoKVError("compression_sparsity",
                          f"got {args.compression_sparsity!r}; want e.g. 0.5 or 0.25,0.5,0.75") from None
    for v in values:
        if not 0.0 <= v < 1.0:
            raise NanoKVError("compression_sparsity", f"got {v}; must be in [0, 1)")
    knobs = {k: v for k, v in (("sink_blocks", args.sparsity_sinks), ("recent_blocks", args.sparsity_recent),
                                ("min_ranked", args.sparsity_min_ranked), ("score_mode", args.sparsity_score),
                                ("probe_window", args.sparsity_probe_window))
             if v is not None}
    try:
        return [SparsityParams(v, pol, **knobs) for pol in policies for v in values if v > 0.0]
    except ValueError as e:
        raise NanoKVError("sparsity", str(e)) from None


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    from tqdm import tqdm

    from nanokv_tools.eval.passkey import run_passkey
    from nanokv_tools.eval.perplexity import run_perplexity
    from nanokv_tools.eval.runners import build

    lengths = _check(args)
    if args.threads < 1:
        raise NanoKVError("threads", f"got {args.threads}; must be >= 1")
    import torch
    torch.set_num_threads(args.threads)
    tiers = settings.lower_tiers(args.lower_tier_format)
    chosen = [settings.preset(n) for n in args.setting] or ([] if tiers else [
        settings.from_args(args.quantization_bitwidth, args.layer_bits, args.rotation)])
    chosen += [t for t in tiers if t.name not in {c.name for c in chosen}]
    chosen += [s.with_sparsity(v) for s in list(chosen) for v in sparsity_variants(args)]
    path, text = corpus.read_corpus(args.corpus) if args.tokens else (None, "")
    longest = max([args.context if args.tokens else 0] + [L + MAX_NEW for L in lengths])
    bs = args.block_size
    t0 = time.monotonic()
    extra = {"seed": args.seed, "batch_invariant": args.batch_invariant == "on",
             "weight_quantization": args.weight_quantization}
    bench = build(chosen, args.model, num_blocks=-(-longest // bs) + 2, block_size=bs, max_model_len=longest,
                  extra=extra)
    mc = bench.engine.model_config
    if longest > mc.max_position_embeddings:
        raise NanoKVError("context", f"{longest} tokens exceed the model's {mc.max_position_embeddings}")
    windows: list[list[int]] = []
    if args.tokens:
        if bench.engine.tokenizer is None:
            raise NanoKVError("model", "this model has no tokenizer; perplexity needs one")
        toks = list(bench.engine.tokenizer(text, add_special_tokens=False)["input_ids"])
        windows = corpus.make_windows(toks, args.tokens, args.context)
    bar = tqdm(total=args.tokens + len(lengths) * args.passkey_trials, unit="tok", disable=args.no_progress,
               desc="eval", file=sys.stderr)
    comps = run_perplexity(bench, windows, args.chunk, bar.update) if windows else {}
    pk_chunk = args.chunk if args.passkey_prefill == "chunked" else None
    pk = run_passkey(bench, lengths, args.passkey_trials, args.seed, bar.update, pk_chunk) if lengths else {}
    bar.close()

    L, H, D = mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim
    bf16 = settings.bytes_per_token(settings.PRESETS["fp"], L, H, D, bs)
    fp_pk = pk.get("fp", {})
    ref = next(iter(comps.values())).summary() if comps else {}
    rows: list[dict[str, Any]] = [{
        "name": "fp (reference)", "bytes_per_token": bf16, "pct_of_bf16": 100.0,
        "perplexity": {"ppl": ref["ref_ppl"], "delta_ppl_pct": 0.0, "kl_mean": 0.0, "kl_p999": 0.0,
                       "top1_agreement": 1.0, "tokens": ref["tokens"]} if ref else None,
        "passkey": fp_pk or None, **_peaks(bench, "fp", None),
    }]
    for s in chosen:
        bpt = settings.bytes_per_token(s, L, H, D, bs)
        acc = pk.get(s.name, {})
        rows.append({
            "name": s.name, "setting": s.describe(),
            "layer_bits": [c.bits for c in bench.runners[s.name].kv_caches],
            "rotated_layers": [i for i, c in enumerate(bench.runners[s.name].kv_caches) if c.rotate],
            "bytes_per_token": bpt, "pct_of_bf16": 100.0 * bpt / bf16,
            "perplexity": comps[s.name].summary() if s.name in comps else None,
            "passkey": acc or None,
            "passkey_relative_to_fp": {k: (a / fp_pk[k] if fp_pk.get(k) else None)
                                       for k, a in acc.items()} or None,
            "compression_error": {str(k): v for k, v in bench.monitors[s.name].snapshot_kv().items()},
            **_peaks(bench, s.name, s.name.split(" ")[0] if s.sparsity is not None else None),
        })
    return {
        "model": args.model or "SmolLM2-135M-Instruct (embedded GGUF)", "corpus": str(path) if path else None,
        "tokens": args.tokens, "context": args.context, "chunk": args.chunk, "block_size": bs,
        "passkey_lengths": lengths, "passkey_trials": args.passkey_trials if lengths else 0,
        "passkey_prefill": args.passkey_prefill,
        "command": "nanokv eval " + shlex.join(argv),
        "settings": rows, "passkey_samples": pk.get("samples", []), "elapsed_s": time.monotonic() - t0,
    }


def _peaks(bench: Any, name: str, dense: str | None) -> dict[str, Any]:
    """Measured peak live KV of one sequence (nanokv_tools.eval.sparse), per phase; for a sparse setting
    also as a fraction of its dense setting's peak on the same sequences."""
    out: dict[str, Any] = {
        "peak_kv_bytes": {ph: d[name] for ph, d in bench.peak_bytes.items() if name in d} or None,
        "peak_kv_blocks": {ph: d[name] for ph, d in bench.peak_blocks.items() if name in d} or None,
    }
    # every setting against the reference's dense cache counted as bf16, on the same sequences
    out["peak_vs_bf16"] = {ph: d[name] / d["fp"] for ph, d in bench.peak_bytes.items()
                           if name in d and d.get("fp")} or None
    if dense is not None:
        out["dense_setting"] = dense
        # the fraction of full blocks dropped / demoted, averaged over every step (the early steps of a
        # sequence drop less: sinks and the recent window are always kept)
        out["mean_fraction"] = _fractions(bench.sparse_totals, bench.peak_bytes, name)
        # the same at each sequence's last step (pooled over sequences): what the budget reaches
        out["end_fraction"] = _fractions(bench.sparse_end, bench.peak_bytes, name)
        out["peak_vs_dense"] = {ph: d[name] / d[dense] for ph, d in bench.peak_bytes.items()
                                if name in d and d.get(dense)} or None
    return out


def _fractions(counts: dict[str, dict[str, int]], phases: Any, name: str) -> dict[str, Any] | None:
    return {ph: {"dropped": t["dropped"] / t["full"], "demoted": t["demoted"] / t["full"]}
            for ph in phases if (t := counts.get(f"{ph}:{name}")) and t["full"]} or None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    try:
        result = run(args, argv)
    except NanoKVError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from nanokv_tools.eval.report import table

    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    print(table(result))
    return 0
