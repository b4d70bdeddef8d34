"""CPU benchmark: a fixed seeded batch on the embedded model, nanokv vs HF transformers `generate`.

Workload (seed 0): N = 64 requests of random token ids, prompt lengths uniform in [32, 512],
output lengths uniform in [16, 256]; greedy, EOS ignored; at most 16 in flight. Throughput =
requested output tokens / wall time. nanokv runs them with continuous batching (max_num_seqs 16).
HF `generate` serves the same requests, in arrival order, as left-padded static batches of 16, each
run to its longest request: it cannot retire a finished row or admit a new one mid-batch.
"""

from __future__ import annotations

import copy
import random
import time
from typing import Any

import torch
from tqdm import tqdm

BATCH = 16


def make_workload(num_seqs: int, seed: int = 0, vocab: int = 49152) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 512))] for _ in range(num_seqs)]
    outs = [rng.randint(16, 256) for _ in range(num_seqs)]
    return prompts, outs


def run_nanokv(engine_kw: dict[str, Any], prompts, outs, split: bool = False
               ) -> tuple[float, list[list[int]], dict[str, Any]]:
    """The workload through LLM(): services in this process, or (split) cache and compute started
    as separate processes and reached over gRPC on unix sockets. Returns seconds, tokens, and the
    gateway's RPC counters for the timed part."""
    from nanokv.config import EngineConfig
    from nanokv.gateway.llm import LLM
    from nanokv.launch import start_services
    from nanokv.sampling import SamplingParams

    kw = {"device": "cpu", "max_num_seqs": BATCH, "max_num_batched_tokens": 512, **engine_kw}
    svc = start_services(EngineConfig.from_kwargs(**kw).to_dict()) if split else None
    try:
        addr = {"cache_address": svc.cache_address, "compute_address": svc.compute_address} if svc else {}
        llm = LLM(**kw, **addr)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        llm.engine.reset_counters()  # (and the prefix cache)
        t = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=True)
        dt = time.perf_counter() - t
        rpc = llm.engine.stats()["rpc"]
        llm.engine.shutdown()
    finally:
        if svc is not None:
            svc.stop()
    steps = max(rpc["steps"], 1)
    per_step = {"steps": rpc["steps"], "rpcs_per_step": (rpc["plan_calls"] + rpc["step_calls"]) / steps,
                "plan_ms_per_step": 1e3 * rpc["plan_s"] / steps, "step_call_ms_per_step": 1e3 * rpc["step_s"] / steps}
    return dt, [r.token_ids for r in res], per_step


def run_hf(prompts, outs) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    from nanokv.compute_service.model.loader import embedded_model_path

    path = embedded_model_path()
    import os
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    model.eval()
    pad = 0
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = [-1]  # no token has id -1: every row runs to max_new_tokens, as ignore_eos
    gc.pad_token_id = pad
    gc.do_sample = False
    results: list[list[int]] = []
    with torch.inference_mode():
        gc.max_new_tokens = 4
        model.generate(torch.tensor([prompts[0][:16]]), generation_config=gc)  # warm-up
        t = time.perf_counter()
        for b in tqdm(range(0, len(prompts), BATCH), desc="hf generate", unit="batch"):
            ps, os_ = prompts[b:b + BATCH], outs[b:b + BATCH]
            L = max(len(p) for p in ps)
            ids = torch.tensor([[pad] * (L - len(p)) + p for p in ps])
            mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ps])
            gc.max_new_tokens = max(os_)
            gen = model.generate(ids, attention_mask=mask, generation_config=gc)
            results.extend(gen[i, L:L + n].tolist() for i, n in enumerate(os_))
        dt = time.perf_counter() - t
    return dt, results


def run_cpu_bench(engine_kw: dict[str, Any], compare: bool = True, quick: bool = False,
                  num_seqs: int | None = None) -> dict[str, Any]:
    n = num_seqs or (4 if quick else 64)
    prompts, outs = make_workload(n)
    total = sum(outs)
    t_nano, toks_nano, rpc_local = run_nanokv(engine_kw, prompts, outs)
    t_split, toks_split, rpc_split = run_nanokv(engine_kw, prompts, outs, split=True)
    result: dict[str, Any] = {
        "workload": "cpu", "num_seqs": n, "output_tokens": total,
        "prompt_tokens": sum(len(p) for p in prompts), "torch_threads": torch.get_num_threads(),
        "nanokv": {"seconds": t_nano, "output_tokens_per_s": total / t_nano, **rpc_local},
        "nanokv_split": {"seconds": t_split, "output_tokens_per_s": total / t_split, **rpc_split,
                         "identical_outputs": sum(a == b for a, b in zip(toks_nano, toks_split))},
    }
    print(f"nanokv (services in one process): {total} output tokens in {t_nano:.2f} s = {total / t_nano:.1f} tok/s")
    print(f"nanokv (three processes, gRPC):   {total} output tokens in {t_split:.2f} s = {total / t_split:.1f} tok/s"
          f" ({t_nano / t_split:.1%} of one process; greedy outputs identical: "
          f"{result['nanokv_split']['identical_outputs']}/{n})")
    for name, r in (("one process", rpc_local), ("gRPC", rpc_split)):
        print(f"  {name}: {r['steps']} steps, {r['rpcs_per_step']:.2f} service calls per step, plan "
              f"{r['plan_ms_per_step']:.2f} ms + step call {r['step_call_ms_per_step']:.2f} ms per step")
    if compare:
        t_hf, toks_hf = run_hf(prompts, outs)
        same = sum(a == b for a, b in zip(toks_nano, toks_hf))
        result["hf"] = {"seconds": t_hf, "output_tokens_per_s": total / t_hf}
        result["speedup"] = t_hf / t_nano
        result["identical_outputs"] = f"{same}/{n}"
        print(f"HF transformers generate: {total / t_hf:.1f} tok/s")
        print(f"speedup nanokv / HF: {t_hf / t_nano:.2f}x  (greedy outputs identical: {same}/{n})")
    return result
