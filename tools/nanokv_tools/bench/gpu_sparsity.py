"""Block sparsity on the GPU: the hybrid kernels at real shapes, then serving under one KV memory budget.

    python -m nanokv_tools.bench.gpu_sparsity --out out/sparsity [--num-seqs 32 --long-num-seqs 4 --scale 1]

1. Kernels: nanokv.kernels.triton_hybrid (decode, split-K and not; prefill chunks) on tables that mix int8
   pool blocks, INT4 demotion-store slots and holes, at Llama-3-8B (32/8 heads) and Qwen3-0.6B (16/8)
   shapes, D = 128, fp16 and bf16 queries, against the torch reference (nanokv.kernels.reference), plus
   each one's time next to the plain int8 decode kernel on the same lengths with no holes
   (nanokv_tools.bench.sparsity_kernels; decode also on the hybrid policy's own s = 0.5 mix).
2. Serving on a random-weight Qwen3-0.6B (nanokv_tools.bench.gpu's model and greedy, EOS-ignored runs):
     longctx  inputs 2-4k, outputs 0.5-1k tokens (128 sequences in the issue; --num-seqs)
     long32k  inputs 16-32k, outputs 0.5-1k (--long-num-seqs): KV memory is the limit
   for int8, int8 + streaming@s, attention@s, hybrid@s (s = --sparsity), every one in the same KV bytes
   (--kv-gib: the int8 pool, and for hybrid the pool plus its INT4 demotion store). Reported: output
   tok/s, TTFT and TPOT p50/p99, the most sequences running at once, the largest live KV bytes of one
   sequence (sampled every --sample-every steps), preemptions. --scale multiplies every length;
   --max-num-seqs caps the batch of every run (TPOT at equal batch); --profile-steps A:B prints where steps
   A..B-1 of every run spend device and host time.
Prints a line per run and writes sparsity.json under --out. --device cpu --tiny: a seconds-long smoke of
the same code (tiny random model, the torch backend; no kernel section).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

import torch

from nanokv_tools.bench.sparsity_kernels import kernel_checks

CONFIGS = ("int8", "streaming", "attention", "hybrid")


def workload(name: str, n: int, scale: float, vocab: int = 10000) -> tuple[list[list[int]], list[int]]:
    inp, out = {"longctx": ((2048, 4096), (512, 1024)), "long32k": ((16384, 32768), (512, 1024))}[name]
    rng = random.Random(0)
    lens = [max(1, int(rng.randint(*inp) * scale)) for _ in range(n)]
    outs = [max(1, int(rng.randint(*out) * scale)) for _ in range(n)]
    return [[rng.randrange(0, vocab) for _ in range(L)] for L in lens], outs


def engine_kw(config: str, sparsity: float, kv_bytes: int, base: dict[str, Any]) -> dict[str, Any]:
    """Engine settings of one configuration, its pool sized so that pool (+ demotion store) = kv_bytes."""
    from nanokv.compute_service.model.config import ModelConfig
    from nanokv.kv.cache import bytes_per_block
    from nanokv.kv.demote import slot_bytes
    from nanokv.sparsity import SparsityParams, parse_options

    mc = ModelConfig.preset(base["model"].removeprefix("random:"))
    H, D, L, bs = mc.num_key_value_heads, mc.head_dim, mc.num_hidden_layers, base["block_size"]
    block = L * bytes_per_block(8, H, bs, D, torch.bfloat16)
    kw = dict(base, enable_compression=True, quantization_bitwidth=8)
    if config != "int8":
        kw.update(compression_sparsity=sparsity, sparsity_policy=config)
    # the store holds store_fraction slots per pool block (SparsityParams; --sparsity-options may set it)
    frac = parse_options(base.get("sparsity_options", "")).get("store_fraction", SparsityParams(0.5).store_fraction)
    store = frac * L * slot_bytes(H, bs, D) if config == "hybrid" else 0.0
    kw["num_gpu_blocks"] = int(kv_bytes // (block + store))
    return kw


def serve_run(kw: dict[str, Any], prompts: list[list[int]], outs: list[int], sample_every: int,
              profile_steps: tuple[int, int] | None = None) -> dict[str, Any]:
    from nanokv.compute_service.model.config import ModelConfig
    from nanokv.compute_service.sparsity.accounting import KVBytes
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outs]
    llm = LLM(**kw)
    eng = llm.engine
    mc = ModelConfig.preset(kw["model"].removeprefix("random:"))
    acct = KVBytes([8] * mc.num_hidden_layers, mc.num_key_value_heads, eng.config.block_size, mc.head_dim)
    llm.generate([p[:64] for p in prompts[:2]], params[:2], use_tqdm=False)  # compile, capture
    eng.reset_counters()
    seen = {"steps": 0, "max_running": 0, "max_seq_kv_bytes": 0}
    inner, sched, cm = eng.step, eng.scheduler, eng.cache_manager

    prof = None  # torch.profiler over steps [a, b) of the run (--profile-steps): where a config's time goes

    def step(*a, **k):
        nonlocal prof
        if profile_steps is not None and seen["steps"] == profile_steps[0]:
            acts = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            prof = torch.profiler.profile(activities=acts)
            prof.start()
        res = inner(*a, **k)
        seen["steps"] += 1
        if prof is not None and seen["steps"] == profile_steps[1]:  # type: ignore[index]
            prof.stop()
        running = sched.running
        seen["max_running"] = max(seen["max_running"], len(running))
        if seen["steps"] % sample_every == 0:
            for s in running:
                if cm.has_seq(s.seq_id):
                    t = cm.block_table(s.seq_id)
                    seen["max_seq_kv_bytes"] = max(seen["max_seq_kv_bytes"], acct.live(t, len(t) * acct.block_size))
        return res

    eng.step = step  # type: ignore[method-assign]
    t0 = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    bad = [r.error or f"{len(r.token_ids)} of {o}" for r, o in zip(res, outs) if r.error or len(r.token_ids) != o]
    if bad:
        raise RuntimeError(f"{len(bad)} requests did not run to max_tokens: {bad[:3]}")
    ttft, tpot = [], []
    for r in res:
        first, fin = r.metrics.first_token_time, r.metrics.finish_time
        assert first is not None and fin is not None  # (every request ran to the end)
        ttft.append(first - r.metrics.arrival_time)
        tpot.append((fin - first) / max(1, len(r.token_ids) - 1))
    ttft.sort()
    tpot.sort()

    def pct(xs: list[float], p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    if prof is not None:
        if seen["steps"] < profile_steps[1]:  # type: ignore[index]  # (the run ended inside the window)
            prof.stop()
        by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=by, row_limit=25), flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    sp = eng.sparsity  # (the in-process cache service's decisions and counters; None for int8)
    out = {"seconds": dt, "output_tokens_per_s": sum(outs) / dt, "ttft_p50_s": pct(ttft, 0.5),
           "ttft_p99_s": pct(ttft, 0.99), "tpot_p50_s": pct(tpot, 0.5), "tpot_p99_s": pct(tpot, 0.99),
           "max_running": seen["max_running"], "max_seq_kv_bytes": seen["max_seq_kv_bytes"],
           "preemptions": eng.scheduler.num_preemptions, "kv_blocks": eng.num_kv_blocks,
           "sparsity": sp.stats() if sp is not None else None, "steps": seen["steps"]}
    eng.shutdown()
    del llm, eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".", help="directory for sparsity.json")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a tiny random model and workload (the CPU smoke)")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--workloads", default="longctx,long32k")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--num-seqs", type=int, default=32, help="longctx sequences (the issue: 128)")
    p.add_argument("--long-num-seqs", type=int, default=4, help="long32k sequences")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every input and output length")
    p.add_argument("--kv-gib", type=float, default=4.0, help="KV bytes of every configuration")
    p.add_argument("--sample-every", type=int, default=8, help="steps between live-KV samples")
    p.add_argument("--sparsity-options", default="", help="sparsity_options of every sparse run, e.g. probe_window=32")
    p.add_argument("--profile-steps", default="", help="A:B: torch.profiler over steps A..B-1 of every run, "
                   "its top device kernels and host ops printed (timings of a profiled run are not benchmark figures)")
    p.add_argument("--max-num-seqs", type=int, default=0,
                   help="cap on sequences running at once in every run (0: the engine's default); equal caps "
                        "compare TPOT at equal batch")
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    profile = None
    if args.profile_steps:
        try:
            a, b = (int(x) for x in args.profile_steps.split(":"))
        except ValueError:
            p.error(f"--profile-steps: got {args.profile_steps!r}; want A:B, e.g. 400:460")
        if not 0 <= a < b:
            p.error(f"--profile-steps: got {args.profile_steps!r}; want 0 <= A < B")
        profile = (a, b)
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: {bad} not of {CONFIGS}")
    result: dict[str, Any] = {"args": vars(args), "date": time.strftime("%Y-%m-%d"),
                              "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"}
    if args.device == "cuda" and not args.skip_kernels and not args.tiny:
        result["kernels"] = kernel_checks("cuda")
    base: dict[str, Any] = {"model": "random:tiny-llama" if args.tiny else "random:qwen3-0.6b", "block_size": 16,
                            "device": args.device, "max_model_len": 40960,
                            "sparsity_options": args.sparsity_options}
    if args.max_num_seqs:
        base["max_num_seqs"] = args.max_num_seqs
    kv_bytes = int(args.kv_gib * 2**30)
    if args.tiny:  # lengths / 20, a few sequences, a 256 KiB pool: every configuration in seconds
        base.update(max_model_len=2048, attention_backend="torch", enforce_eager=True,
                    sparsity_options="sink_blocks=1,recent_blocks=2,min_ranked=0")
        args.scale, args.num_seqs, args.long_num_seqs = min(args.scale, 0.05), min(args.num_seqs, 4), 2
        kv_bytes = 1 << 18
    counts = {"longctx": args.num_seqs, "long32k": args.long_num_seqs}
    result["serving"] = []
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sparsity.json")

    def save() -> None:  # after every run: a device call cut short keeps what it measured
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)

    for wl in [w for w in args.workloads.split(",") if w]:
        if wl not in counts:
            p.error(f"--workloads: {wl!r} not of {tuple(counts)}")
        prompts, outs = workload(wl, counts[wl], args.scale, 1000 if args.tiny else 10000)
        for cfg in configs:
            kw = engine_kw(cfg, args.sparsity, kv_bytes, base)
            r = serve_run(kw, prompts, outs, args.sample_every, profile)
            r.update(workload=wl, config=cfg if cfg == "int8" else f"{cfg}@{args.sparsity}", num_seqs=len(prompts))
            result["serving"].append(r)
            print(f"[{wl}] {r['config']:15s} {r['output_tokens_per_s']:9,.0f} tok/s  TTFT p50/p99 "
                  f"{r['ttft_p50_s']:.2f}/{r['ttft_p99_s']:.2f} s  TPOT p50/p99 {1e3 * r['tpot_p50_s']:.1f}/"
                  f"{1e3 * r['tpot_p99_s']:.1f} ms  running<= {r['max_running']}  seq KV<= "
                  f"{r['max_seq_kv_bytes'] / 2**20:.2f} MiB  preemptions {r['preemptions']}  blocks {r['kv_blocks']}")
            save()
    save()
    print(f"wrote {path}")
    return 0 if all(r["ok"] for r in result.get("kernels", [])) else 1


if __name__ == "__main__":
    raise SystemExit(main())
