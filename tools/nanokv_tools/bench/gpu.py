"""GPU throughput benchmarks on a random-weight Qwen3-0.6B, with the roofline floor of the workload.

Workloads (seed 0, EOS ignored, as nano-vllm's bench.py):
  nanovllm  256 sequences, input and output lengths uniform in [100, 1024]
  longctx   128 sequences, input uniform in [2048, 4096], output in [512, 1024]  (KV-bound)

Floor: the fewest bytes the workload must move, over the copy bandwidth measured in this run, plus
its prefill FLOPs over the measured bf16 matmul rate. Bytes: every decode step reads the weights once
and each active sequence's whole KV; with all sequences decoding together, step t (0-based) runs the
sequences whose output is longer than t, each reading input + t tokens of KV.
"""

from __future__ import annotations

import gc
import random
import time
from typing import Any

import torch

WORKLOADS: dict[str, dict[str, Any]] = {
    "nanovllm": dict(num_seqs=256, inp=(100, 1024), out=(100, 1024)),
    "longctx": dict(num_seqs=128, inp=(2048, 4096), out=(512, 1024)),
}


def make_workload(name: str, num_seqs: int | None = None, vocab: int = 151936):
    w = WORKLOADS[name]
    n = num_seqs or w["num_seqs"]
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 10000) for _ in range(rng.randint(*w["inp"]))] for _ in range(n)]
    outs = [rng.randint(*w["out"]) for _ in range(n)]
    return prompts, outs


def measure_copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second of a large device-to-device copy (median of 20)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    times = []
    for i in range(25):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return 2 * n / times[len(times) // 2]


def measure_matmul_rate(device: torch.device) -> float:
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        a @ b
    e.record()
    torch.cuda.synchronize()
    return 10 * 2 * n**3 / (s.elapsed_time(e) / 1e3)


def roofline_floor(mc, prompts, outs, bw: float, flops: float, kv_bytes_per_token: int) -> dict[str, float]:
    weight_bytes = 0
    E, I, L = mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers
    Hq, Hk, D = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    per_layer = E * (Hq * D) + 2 * E * (Hk * D) + (Hq * D) * E + 3 * E * I
    params = L * per_layer + mc.vocab_size * E  # tied embedding read once per step by the LM head
    weight_bytes = params * 2
    steps = max(outs)
    kv_tokens = 0
    for p, o in zip(prompts, outs):
        kv_tokens += o * len(p) + o * (o - 1) // 2
    moved = steps * weight_bytes + kv_tokens * kv_bytes_per_token
    prefill_flops = sum(2 * params * len(p) + 2 * 2 * L * Hq * D * len(p) ** 2 / 2 for p in prompts)
    t = moved / bw + prefill_flops / flops
    return {"bytes_moved": moved, "prefill_flops": prefill_flops, "floor_seconds": t,
            "floor_output_tokens_per_s": sum(outs) / t}


def run_hf(mc_name: str, prompts, outs, device) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig  # noqa: F401

    from nanokv.compute_service.model.config import ModelConfig

    mc = ModelConfig.preset(mc_name)
    from transformers import Qwen3Config
    hf_cfg = Qwen3Config(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
                         intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_hidden_layers,
                         num_attention_heads=mc.num_attention_heads, num_key_value_heads=mc.num_key_value_heads,
                         head_dim=mc.head_dim, max_position_embeddings=mc.max_position_embeddings,
                         tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    gen = GenerationConfig(max_new_tokens=max(outs), do_sample=False, eos_token_id=-1, pad_token_id=0)
    t = time.perf_counter()
    model.generate_batch(inputs=prompts, generation_config=gen)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def bench_warm_up(llm: Any, prompts: list[list[int]], params: list[Any]) -> None:
    """The benchmark's warm-up before its timed run: compile kernels, capture graphs; prompts past
    one step's token budget, so a chunk continues in the next step and the paged prefill kernel is
    compiled too (not in the timed run). Leaves an empty prefix cache and zeroed counters."""
    eng = llm.engine
    n = 4
    while n < len(prompts) and sum(map(len, prompts[:n])) <= eng.config.max_num_batched_tokens:
        n += 1
    llm.generate(prompts[:n], params[:n], use_tqdm=False)
    eng.reset_counters()  # (and the prefix cache)


def _rpc_summary(rpc: dict[str, Any], seconds: float) -> dict[str, float]:
    """Service calls per scheduling step and the gateway's time in them. The step call is the
    launch (send) plus the collect (wait for the sampled ids); with async scheduling the wait
    overlaps the device running the step, so `step_s` counts time the gateway was blocked, and
    `hidden` is the part of the run in which the gateway worked while the device ran."""
    steps = max(rpc["steps"], 1)
    return {"steps": rpc["steps"], "rpcs_per_step": (rpc["plan_calls"] + rpc["step_calls"]) / steps,
            "plan_ms_per_step": 1e3 * rpc["plan_s"] / steps, "step_call_ms_per_step": 1e3 * rpc["step_s"] / steps,
            "build_ms_per_step": 1e3 * rpc.get("build_s", 0.0) / steps,
            "tokens_ms_per_step": 1e3 * rpc.get("tokens_s", 0.0) / steps,
            "plan_rtt_ms_per_step": 1e3 * rpc.get("plan_rtt_s", 0.0) / steps,  # plans sent ahead (gRPC)
            "step_ms": 1e3 * seconds / steps,
            "gateway_busy_share": max(0.0, 1 - (rpc["step_s"]) / seconds)}


def _timed_run(kw: dict[str, Any], prompts, outs, split: bool) -> dict[str, Any]:
    """One transport: services in this process, or cache + compute as processes over gRPC (the
    pool shared by CUDA IPC). Returns seconds, tokens and counters of the timed part."""
    from nanokv.config import EngineConfig
    from nanokv.gateway.llm import LLM
    from nanokv.launch import start_services
    from nanokv.sampling import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outs]
    svc = start_services(EngineConfig.from_kwargs(**kw).to_dict()) if split else None
    try:
        addr = {"cache_address": svc.cache_address, "compute_address": svc.compute_address} if svc else {}
        llm = LLM(**kw, **addr)
        eng = llm.engine
        bench_warm_up(llm, prompts, params)
        gc_time = [0.0, 0.0, 0]  # start of the current collection, total seconds, full collections

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                gc_time[0] = time.perf_counter()
            else:
                gc_time[1] += time.perf_counter() - gc_time[0]
                gc_time[2] += info["generation"] == 2
        gc.callbacks.append(on_gc)
        t = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=True)
        dt = time.perf_counter() - t
        gc.callbacks.remove(on_gc)
        if not all(len(r.token_ids) == o for r, o in zip(res, outs)):
            raise RuntimeError("a request ended before its max_tokens (ignore_eos is set)")
        st = eng.stats()
        out: dict[str, Any] = {
            "seconds": dt, "output_tokens_per_s": sum(outs) / dt, "kv_blocks": eng.num_kv_blocks,
            "preemptions": eng.scheduler.num_preemptions, "gc_seconds": gc_time[1],
            "gc_full_collections": gc_time[2], "rpc": st["rpc"], **_rpc_summary(st["rpc"], dt),
            "tokens": [r.token_ids for r in res],
        }
        if not split:
            out["kv_bytes_per_token"] = eng.runner.bytes_per_block_all_layers() // eng.config.block_size
            out["model_config"] = eng.model_config
            out["config"] = eng.config.to_dict()
        eng.shutdown()
        del llm, eng
    finally:
        if svc is not None:
            svc.stop()
    gc.collect()
    torch.cuda.empty_cache()
    return out


def run_gpu_bench(workload: str, engine_kw: dict[str, Any], compare: bool = False, quick: bool = False,
                  num_seqs: int | None = None, transport: str = "in-process") -> dict[str, Any]:
    """transport "in-process" (LLM() with its services in this process), "split" (cache and compute
    services as processes over gRPC, the pool shared by CUDA IPC) or "both": split first (the
    same pool size for both), then in-process, in this one run, printed side by side."""
    prompts, outs = make_workload(workload, num_seqs or (32 if quick else None))
    kw = {"model": "random:qwen3-0.6b", "max_model_len": 8192, **engine_kw}
    total = sum(outs)
    split_run = None
    if transport in ("split", "both"):  # first: nothing of an in-process engine is on the device meanwhile
        split_run = _timed_run(kw, prompts, outs, split=True)
        kw["num_gpu_blocks"] = split_run["kv_blocks"]  # the same pool for both
        if transport == "split":
            only = {k: v for k, v in split_run.items() if k != "tokens"}
            only.update(workload=workload, transport="split", num_seqs=len(prompts), output_tokens=total,
                        gpu=torch.cuda.get_device_name(0))
            print(f"[{workload} split] {len(prompts)} seqs, {total} output tokens in {only['seconds']:.2f} s = "
                  f"{only['output_tokens_per_s']:,.0f} tok/s; {only['steps']} steps, {only['rpcs_per_step']:.2f} "
                  f"service calls/step, plan {only['plan_ms_per_step']:.2f} ms/step, step call (gateway blocked) "
                  f"{only['step_call_ms_per_step']:.2f} ms/step")
            return only
    device = torch.device("cuda")
    local = _timed_run(kw, prompts, outs, split=False)
    dt = local["seconds"]
    bw = measure_copy_bandwidth(device)
    fl = measure_matmul_rate(device)
    floor = roofline_floor(local["model_config"], prompts, outs, bw, fl, local["kv_bytes_per_token"])
    out: dict[str, Any] = {
        "workload": workload, "num_seqs": len(prompts), "output_tokens": total, "seconds": dt,
        "output_tokens_per_s": total / dt, "copy_bandwidth_Bps": bw, "matmul_flops": fl,
        "gpu": torch.cuda.get_device_name(device), "config": local["config"],
        "preemptions": local["preemptions"], "kv_blocks": local["kv_blocks"], **floor,
        "achieved_over_floor": floor["floor_seconds"] / dt,
        "gc_seconds": local["gc_seconds"], "gc_full_collections": local["gc_full_collections"],
        "rpc": local["rpc"],
    }
    print(f"[{workload}] {len(prompts)} seqs, {total} output tokens in {dt:.2f} s = {total / dt:,.0f} tok/s")
    print(f"  copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {fl / 1e12:.0f} TFLOP/s; Python GC "
          f"{local['gc_seconds']:.3f} s in the timed run ({local['gc_full_collections']} full collections)")
    print(f"  roofline floor {floor['floor_seconds']:.2f} s ({floor['floor_output_tokens_per_s']:,.0f} tok/s);"
          f" achieved/floor = {out['achieved_over_floor']:.1%}")
    if split_run is not None:
        same = sum(a == b for a, b in zip(split_run["tokens"], local["tokens"]))
        out["split"] = {k: v for k, v in split_run.items() if k != "tokens"} | {
            "identical_outputs": same, "over_in_process": local["seconds"] / split_run["seconds"]}
        print(f"[{workload} split] three processes over gRPC, pool by CUDA IPC: "
              f"{split_run['output_tokens_per_s']:,.0f} tok/s = {out['split']['over_in_process']:.1%} of in-process "
              f"({local['output_tokens_per_s']:,.0f}); greedy outputs identical {same}/{len(prompts)}")
        for name, r in (("in-process", local), ("split", split_run)):
            rtt = (f" (round trip {r['plan_rtt_ms_per_step']:.2f} ms: the pipeline hid the rest)"
                   if r["plan_rtt_ms_per_step"] else "")
            print(f"  {name:10s}: {r['steps']} steps, {r['rpcs_per_step']:.2f} service calls/step, gateway in plan "
                  f"calls {r['plan_ms_per_step']:.2f} ms/step{rtt}, step call (gateway blocked) "
                  f"{r['step_call_ms_per_step']:.2f} ms/step, building it {r['build_ms_per_step']:.2f} ms/step, "
                  f"reading tokens {r['tokens_ms_per_step']:.2f} ms/step (a step every {r['step_ms']:.2f} ms), "
                  f"gateway not blocked {r['gateway_busy_share']:.1%} of the run")
    if compare:
        t_hf = run_hf("qwen3-0.6b", prompts, outs, device)
        out["hf_seconds"] = t_hf
        out["hf_output_tokens_per_s"] = total / t_hf
        print(f"  HF transformers generate_batch: {total / t_hf:,.0f} tok/s; nanokv/HF = {t_hf / dt:.1f}x")
    return out
