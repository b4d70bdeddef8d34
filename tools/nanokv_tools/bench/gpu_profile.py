"""Where a decode step's time goes, on a GPU: `python -m nanokv_tools.bench.gpu_profile [--workload nanovllm]`.

Loads the workload, steps until every sequence is decoding, then reports for the full batch:
  - wall time per step (synchronized) and its split: schedule / forward / sample+postprocess;
  - the decode CUDA graph's replay alone (events), logits + argmax alone;
  - host time per step by function (cProfile, top entries);
  - device kernels of a few steps (torch.profiler), by total time.
For finding the gap to the roofline floor; benchmarks proper are `nanokv bench`.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from nanokv_tools.bench.gpu import make_workload


def _events_ms(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def check_fresh_prefill(device: torch.device, dtype: torch.dtype = torch.bfloat16, cudnn: bool = False) -> float:
    """Relative error of the fresh-prompt path (varlen flash; cudnn: fp16 through cuDNN) vs float64
    causal attention, inputs of Qwen3-0.6B head shapes, three packed prompts; NaN poisoned output."""
    from nanokv.kernels.fresh_prefill import sdpa_fresh_prefill
    from nanokv.kv.metadata import AttentionMetadata

    lens = [700, 129, 1500]
    qsl = [0, 700, 829, 2329]
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(qsl[-1], 16, 128, device=device, generator=g).to(dtype)
    k = torch.randn(qsl[-1], 8, 128, device=device, generator=g).to(dtype)
    v = torch.randn(qsl[-1], 8, 128, device=device, generator=g).to(dtype)
    md = AttentionMetadata(slot_mapping=torch.zeros(0), query_start_loc=torch.tensor(qsl, device=device,
                           dtype=torch.int32), seq_lens=torch.tensor(lens), block_tables=torch.zeros(0),
                           num_prefills=3, num_prefill_tokens=qsl[-1], num_decode_tokens=0, max_query_len=1500,
                           max_seq_len=1500, query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    out = torch.full_like(q, float("nan"))
    sdpa_fresh_prefill(q, k, v, md, out, 128 ** -0.5, [0, 1, 2], cudnn=cudnn)
    err = 0.0
    for i in range(3):
        s, e = qsl[i], qsl[i + 1]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].double().transpose(0, 1), k[s:e].double().repeat_interleave(2, 1).transpose(0, 1),
            v[s:e].double().repeat_interleave(2, 1).transpose(0, 1), is_causal=True, scale=128 ** -0.5)
        o = out[s:e].double().transpose(0, 1)
        err = max(err, float((o - ref).norm() / ref.norm()) if not o.isnan().any() else float("inf"))
    return err


def compiled_kernels() -> int:
    """Triton kernel variants compiled so far in this process (a step that adds some paid a JIT
    compile) plus torch.compile's graphs."""
    import triton

    from nanokv.kernels import (
        triton_blockquant,
        triton_decode,
        triton_decode_int4,
        triton_prefill,
        triton_store,
    )
    n = 0
    for mod in (triton_blockquant, triton_decode, triton_decode_int4, triton_prefill, triton_store):
        for obj in vars(mod).values():
            if isinstance(obj, triton.runtime.JITFunction):
                n += sum(len(dc[0]) for dc in getattr(obj, "device_caches", {}).values())
    from torch._dynamo.utils import counters
    return n + int(counters["stats"]["unique_graphs"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="nanovllm")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--bits", type=int, default=16, choices=(16, 8, 4), help="KV cache format (8 / 4: compressed)")
    ap.add_argument("--profile-step", type=int, default=1, help="the prefill step run under the profiler")
    ap.add_argument("--num-seqs", type=int, default=None, help="fewer sequences than the workload's (a tail batch)")
    args = ap.parse_args(argv)
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    prompts, outs = make_workload(args.workload, args.num_seqs)
    err = check_fresh_prefill(torch.device("cuda"))
    print(f"fresh-prompt prefill (varlen flash) vs float64: relative error {err:.2e}")
    quant = dict(enable_compression=True, quantization_bitwidth=args.bits) if args.bits < 16 else {}
    llm = LLM(model="random:qwen3-0.6b", max_model_len=8192, max_num_batched_tokens=args.max_num_batched_tokens,
              **quant)
    eng = llm.engine
    warm = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 4
    llm.generate(prompts[:4], warm, use_tqdm=False)
    eng.cache_manager.reset_prefix_cache()
    for i, (p, o) in enumerate(zip(prompts, outs)):
        eng.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=max(o, 400), ignore_eos=True))
    from torch.profiler import ProfilerActivity, profile
    t0 = time.perf_counter()
    n_pre = 0
    step_ms = []
    compiled = [compiled_kernels()]
    while eng.num_waiting() or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        ts = time.perf_counter()
        if n_pre == args.profile_step:  # one full prefill step under the profiler
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pp:
                eng.step()
                torch.cuda.synchronize()
        else:
            eng.step()
            torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - ts) * 1e3)
        compiled.append(compiled_kernels())
        n_pre += 1
    print(f"prefill: {n_pre} steps, {time.perf_counter() - t0:.2f} s; running {eng.num_running()}; "
          f"step ms {[round(x, 1) for x in step_ms]}")
    print(f"kernels compiled per prefill step: {[b - a for a, b in zip(compiled, compiled[1:])]}")
    if n_pre > args.profile_step:
        print(pp.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
        print(pp.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    else:
        print(f"(no prefill step {args.profile_step} to profile: {n_pre} prefill steps)")
    for _ in range(3):
        eng.step()
    eng.rpc = {k: 0.0 if k.endswith("_s") else 0 for k in eng.rpc}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    tm = eng.rpc
    n = tm["steps"]
    if n and eng._async is None:
        print(f"decode step at batch {eng.num_running()}: {wall:.2f} ms wall; plan {tm['plan_s'] / n * 1e3:.2f} ms, "
              f"forward + sample {tm['step_s'] / n * 1e3:.2f} ms, rest (host post-processing) "
              f"{wall - (tm['plan_s'] + tm['step_s']) / n * 1e3:.2f} ms")
    else:  # async scheduling: host and device overlap, there is no per-part split to report
        print(f"decode step at batch {eng.num_running()}: {wall:.2f} ms wall (async scheduling)")

    # the graph alone, and logits + argmax alone, on this batch
    runner = eng.runner
    sched = eng.scheduler.running
    # re-store each sequence's last computed token (same K/V again): a valid decode step whose slots exist
    items = [(s.token_ids, s.num_computed_tokens - 1, 1, eng.cache_manager.block_table(s.seq_id), False)
             for s in sched]
    with torch.inference_mode():  # the runner's metadata buffers are inference tensors
        t0 = time.perf_counter()
        ids, pos, md, _ = runner.build_metadata(items)
        torch.cuda.synchronize()
        print(f"build_metadata: {(time.perf_counter() - t0) * 1e3:.2f} ms (host, incl. copies)")
        if runner.graphs is not None:
            ms = _events_ms(lambda: runner.graphs.run(ids, pos, md))
            print(f"decode graph replay (batch {len(items)}): {ms:.2f} ms")
        hidden = torch.randn(len(items), eng.model_config.hidden_size, device=runner.device, dtype=runner.dtype)
        ms = _events_ms(lambda: runner.model.compute_logits(hidden).argmax(-1))
        print(f"logits + argmax: {ms:.2f} ms")

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        eng.step()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    print("host: top functions by own time over 10 steps\n" + "\n".join(s.getvalue().splitlines()[:45]))

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            eng.step()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
