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


def run_nanokv(engine_kw: dict[str, Any], prompts, outs) -> tuple[float, list[list[int]]]:
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    kw = {"device": "cpu", "max_num_seqs": BATCH, "max_num_batched_tokens": 512, **engine_kw}
    llm = LLM(**kw)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    llm.engine.cache_manager.reset_prefix_cache()
    t = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=True)
    dt = time.perf_counter() - t
    return dt, [r.token_ids for r in res]


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
    t_nano, toks_nano = run_nanokv(engine_kw, prompts, outs)
    result: dict[str, Any] = {
        "workload": "cpu", "num_seqs": n, "output_tokens": total,
        "prompt_tokens": sum(len(p) for p in prompts), "torch_threads": torch.get_num_threads(),
        "nanokv": {"seconds": t_nano, "output_tokens_per_s": total / t_nano},
    }
    print(f"nanokv: {total} output tokens in {t_nano:.2f} s = {total / t_nano:.1f} tok/s")
    if compare:
        t_hf, toks_hf = run_hf(prompts, outs)
        same = sum(a == b for a, b in zip(toks_nano, toks_hf))
        result["hf"] = {"seconds": t_hf, "output_tokens_per_s": total / t_hf}
        result["speedup"] = t_hf / t_nano
        result["identical_outputs"] = f"{same}/{n}"
        print(f"HF transformers generate: {total / t_hf:.1f} tok/s")
        print(f"speedup nanokv / HF: {t_hf / t_nano:.2f}x  (greedy outputs identical: {same}/{n})")
    return result
