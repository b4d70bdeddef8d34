"""Where a whole benchmark run's device time goes, and what that bounds:
`python -m nanokv_tools.bench.run_breakdown --workload longctx --bits 16|8|4 [--block-size N] [--out FILE]`.

Runs the workload as `nanokv bench` does (same engine settings, warm-up first), once under
torch.profiler (device kernels; host ops too with --host), and sums kernel time by kind: decode attention, prefill
attention, matmuls, KV writes (store / quantize), the rest; the wall time minus all kernel time is
the device's idle time (host-bound stretches). Decode attention is then set against its floor, the
KV bytes the decode steps must read over the copy bandwidth measured in the same process, so a
reader sees what the rest of the run costs whatever the attention kernel does: the bound on any
speed-up of the KV format alone. Profiling slows the host a little, so the wall time is of this run,
not a benchmark figure.
"""

from __future__ import annotations

import argparse
import re
import time

import torch

from nanokv_tools.bench import write_json
from nanokv_tools.bench.gpu import make_workload, measure_copy_bandwidth

KINDS = [  # first match wins; names as the profiler reports kernels on the H200 (Triton, cuBLAS, flash)
    ("decode_attention", r"_decode_kernel|decode_int4|decode_int8_swap|_reduce_kernel"),
    ("prefill_attention", r"flash|fmha|_prefill_kernel|read_?back"),
    ("matmul", r"nvjet|gemm|cutlass|splitKreduce|xmma|cublas"),
    ("kv_write", r"store|blockquant|fill_|quantize"),
]


def kind_of(name: str) -> str:
    for kind, pat in KINDS:
        if re.search(pat, name):
            return kind
    return "other"


def decode_kv_bytes(prompts, outs, bytes_per_token: int) -> int:
    """KV bytes every decode step reads: step t of a sequence reads its prompt plus t tokens."""
    return sum(o * len(p) + o * (o - 1) // 2 for p, o in zip(prompts, outs)) * bytes_per_token


def idle_profile(prof, windows: int = 20) -> dict[str, object]:
    """From the profiler's kernel intervals: device idle time before and after the last prefill
    kernel (prefill phase / decode phase) and the busy fraction of each of `windows` equal slices of
    the run, so a reader sees where the device waited for the host."""
    spans = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                   if ev.device_type.name == "CUDA" and ev.time_range.end > ev.time_range.start)
    if not spans:
        return {}
    t0, t1 = spans[0][0], max(e for _, e, _ in spans)
    last_prefill = max((s for s, _, n in spans if re.search(KINDS[1][1], n)), default=t0)
    busy = [0.0] * windows
    idle = {"prefill_phase_s": 0.0, "decode_phase_s": 0.0}
    width = (t1 - t0) / windows
    end = t0
    for s, e, _ in spans:
        if s > end:  # a gap (s - end) with nothing running
            idle["prefill_phase_s" if s <= last_prefill else "decode_phase_s"] += (s - end) / 1e6
        s, e = max(s, end), max(e, end)  # count overlapping kernels once
        for w in range(int((s - t0) // width), min(int((e - t0) // width), windows - 1) + 1):
            lo, hi = t0 + w * width, t0 + (w + 1) * width
            busy[w] += max(0.0, min(e, hi) - max(s, lo))
        end = e
    return {**idle, "prefill_phase_end_s": (last_prefill - t0) / 1e6,
            "busy_fraction_per_window": [round(b / width, 3) for b in busy]}


def largest_gaps(prof, n: int = 10, host_ops: int = 4) -> list[dict[str, object]]:
    """The n longest stretches with no kernel running: where in the run (s from the first kernel),
    how long, the kernels on either side, and, when host events were profiled (--host), the host
    ops that overlap the gap most (name, seconds of overlap): what the device was waiting for."""
    dev = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                 if ev.device_type.name == "CUDA" and ev.time_range.end > ev.time_range.start)
    host = [(ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
            if ev.device_type.name == "CPU"]
    gaps, end, last = [], dev[0][0] if dev else 0, ""
    for s, e, name in dev:
        if s > end:
            gaps.append((s - end, end, s, last, name))
        if e >= end:
            end, last = e, name
    out: list[dict[str, object]] = []
    for length, a, b, before, after in sorted(gaps, reverse=True)[:n]:
        over: dict[str, float] = {}
        for hs, he, name in host:
            o = min(he, b) - max(hs, a)
            if o > 0:
                over[name] = over.get(name, 0.0) + o / 1e6
        out.append({"at_s": (a - dev[0][0]) / 1e6, "idle_s": length / 1e6, "before": before, "after": after,
                    "host": sorted(over.items(), key=lambda kv: -kv[1])[:host_ops]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="longctx")
    ap.add_argument("--bits", type=int, default=16, choices=(16, 8, 4))
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--block-size", type=int, default=0, help="0: EngineConfig's auto (int4 32, else 16)")
    ap.add_argument("--out", default=None, help="JSON file")
    ap.add_argument("--host", action="store_true",
                    help="also profile host ops, to name what overlaps the longest idle gaps (slows the host)")
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    prompts, outs = make_workload(args.workload)
    quant = dict(enable_compression=True, quantization_bitwidth=args.bits) if args.bits < 16 else {}
    llm = LLM(model="random:qwen3-0.6b", max_model_len=8192, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size, **quant)
    eng = llm.engine
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outs]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
    eng.cache_manager.reset_prefix_cache()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.host else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    sums: dict[str, float] = {k: 0.0 for k, _ in KINDS} | {"other": 0.0}
    top: dict[str, float] = {}
    for ev in prof.key_averages():
        dt = ev.self_device_time_total / 1e6  # us -> s
        if dt <= 0:
            continue
        sums[kind_of(ev.key)] += dt
        top[ev.key] = top.get(ev.key, 0.0) + dt
    busy = sum(sums.values())
    bw = measure_copy_bandwidth(eng.device)
    kv_per_token = eng.runner.bytes_per_block_all_layers() // eng.config.block_size
    floor = decode_kv_bytes(prompts, outs, kv_per_token) / bw
    rest = wall - sums["decode_attention"]
    res = {"workload": args.workload, "bits": args.bits, "wall_s": wall, "kernel_s": sums, "busy_s": busy,
           "idle_s": wall - busy, "decode_attention_floor_s": floor, "rest_s": rest,
           "wall_at_floor_s": rest + floor, "output_tokens": sum(outs), "copy_bandwidth_Bps": bw,
           "kv_bytes_per_token": kv_per_token,
           "top_kernels": dict(sorted(top.items(), key=lambda kv: -kv[1])[:40]), **idle_profile(prof),
           "largest_gaps": largest_gaps(prof)}
    print(f"[{args.workload} bits {args.bits}] wall {wall:.2f} s (profiled); kernels {busy:.2f} s,"
          f" idle {wall - busy:.2f} s")
    for k, v in sums.items():
        print(f"  {k:18s} {v:7.2f} s")
    print(f"  decode attention at its floor ({kv_per_token} B/token, {bw / 1e12:.2f} TB/s): {floor:.2f} s;"
          f" rest of the run {rest:.2f} s -> wall at the floor {rest + floor:.2f} s")
    if "busy_fraction_per_window" in res:
        print(f"  device idle: prefill phase (first {res['prefill_phase_end_s']:.2f} s) {res['prefill_phase_s']:.2f} s,"
              f" decode phase {res['decode_phase_s']:.2f} s; busy per twentieth of the run:"
              f" {res['busy_fraction_per_window']}")
    for k, v in list(res["top_kernels"].items())[:8]:
        print(f"    {v:7.3f} s  {k[:90]}")
    print("  longest idle gaps (at s: idle ms, kernel before -> after; host ops overlapping with --host):")
    for g in res["largest_gaps"]:
        host = ", ".join(f"{name[:40]} {o * 1e3:.2f}" for name, o in g["host"])
        print(f"    {g['at_s']:7.3f}: {g['idle_s'] * 1e3:6.2f} ms  {str(g['before'])[:40]} -> {str(g['after'])[:40]}"
              + (f"  [{host}]" if host else ""))
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
