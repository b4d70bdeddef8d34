"""First-run costs of a GPU workload: `python -m nanokv_tools.bench.first_run --bits 4`.

The benchmark (`nanokv.cli bench`) times one run after a short warm-up. Whatever that run does for
the first time (compile a kernel variant, load a cuBLAS kernel, meet a new shape) is in its time.
This builds the engine as the benchmark does, then runs the workload twice in the same process and
reports per run: wall time, host time of the first steps (the prefill phase), the slowest steps;
the Triton compiles and NVRTC builds after start-up; with --profile, the prefill phases of both runs
under torch.profiler, by operator, largest difference first (what it found: docs/kernels.md, "Host
time").
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from nanokv_tools.bench.gpu import bench_warm_up, make_workload

_Row = tuple[float, int, float]  # self CPU us, calls, device us


class _Events:
    """Triton compiles (jit hooks) and NVRTC builds (cuda_decode_int4._kernel misses), timed."""

    def __init__(self) -> None:
        self.log: list[tuple[float, str, str]] = []

    def install(self) -> None:
        import triton

        from nanokv.kernels import cuda_decode_int4 as c4

        def pre(**kw: Any) -> bool:
            self.log.append((time.perf_counter(), "triton compile", str(kw.get("repr", ""))[:160]))
            return False

        def post(**kw: Any) -> None:
            self.log.append((time.perf_counter(), "triton compiled", str(kw.get("repr", ""))[:60]))
        triton.knobs.runtime.jit_cache_hook = pre
        triton.knobs.runtime.jit_post_compile_hook = post
        build = c4._kernel

        def counted(*a: Any, **kw: Any) -> Any:
            n = build.cache_info().misses
            out = build(*a, **kw)
            if build.cache_info().misses > n:
                self.log.append((time.perf_counter(), "nvrtc build", str(a)))
            return out
        c4._kernel = counted  # type: ignore[assignment]

    def mark(self, what: str) -> None:
        self.log.append((time.perf_counter(), "mark", what))


def _table(prof: Any) -> dict[str, _Row]:
    return {e.key: (e.self_cpu_time_total, e.count, e.device_time_total) for e in prof.key_averages()}


def _print_diff(a: dict[str, _Row], b: dict[str, _Row], top: int) -> None:
    zero = (0.0, 0, 0.0)
    for col, name in ((0, "host (self CPU)"), (2, "device")):
        keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, zero)[col] - b.get(k, zero)[col]))
        print(f"prefill phase by operator, largest {name} difference first: self CPU ms run 0 / run 1 (calls), "
              "device ms run 0 / run 1")
        for k in keys[:top]:
            x, y = a.get(k, zero), b.get(k, zero)
            print(f"  {x[0] / 1e3:9.2f} / {y[0] / 1e3:9.2f} ({x[1]}/{y[1]})  device {x[2] / 1e3:8.2f} / "
                  f"{y[2] / 1e3:8.2f}  {k[:90]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="longctx")
    ap.add_argument("--bits", type=int, default=16, choices=(16, 8, 4))
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--prefill-steps", type=int, default=25, help="steps reported (and profiled) as the prefill phase")
    ap.add_argument("--profile", action="store_true", help="torch.profiler over each run's prefill phase")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    events = _Events()
    events.install()
    quant = dict(enable_compression=True, quantization_bitwidth=args.bits) if args.bits < 16 else {}
    prompts, outs = make_workload(args.workload)
    llm = LLM(model="random:qwen3-0.6b", max_model_len=8192, max_num_batched_tokens=args.max_num_batched_tokens,
              **quant)
    eng = llm.engine
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outs]
    bench_warm_up(llm, prompts, params)
    steps: list[tuple[float, int]] = []
    prof: list[Any] = [None]
    tables: list[dict[str, _Row]] = []
    inner = eng.step

    def step(*a: Any, **kw: Any) -> Any:
        if prof[0] is not None and len(steps) == args.prefill_steps:
            prof[0].__exit__(None, None, None)
            tables.append(_table(prof[0]))
            prof[0] = None
        t = time.perf_counter()
        out = inner(*a, **kw)
        steps.append((time.perf_counter() - t, eng.counters.last_batch_size))
        return out
    eng.step = step  # type: ignore[method-assign]
    for run in range(2):
        steps.clear()
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            prof[0] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof[0].__enter__()
        events.mark(f"run {run}")
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        eng.cache_manager.reset_prefix_cache()
        head = steps[:args.prefill_steps]
        print(f"bits {args.bits} run {run}: {dt:.3f} s, {sum(outs) / dt:,.0f} tok/s{' (profiled)' * args.profile}, "
              f"{len(steps)} steps; first {len(head)} steps {sum(s for s, _ in head):.3f} s (ms/batch: "
              + " ".join(f"{s * 1e3:.0f}/{b}" for s, b in head) + ")", flush=True)
        slow = sorted(range(len(steps)), key=lambda i: -steps[i][0])[:8]
        print("  slowest steps (index: ms/batch):",
              " ".join(f"{i}:{steps[i][0] * 1e3:.0f}/{steps[i][1]}" for i in slow))
    if len(tables) == 2:
        _print_diff(tables[0], tables[1], args.top)
    t0 = events.log[0][0] if events.log else 0.0
    print("compiles and builds after start-up, and the runs (s):")
    for t, kind, what in events.log:
        print(f"  {t - t0:8.3f} {kind}: {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
