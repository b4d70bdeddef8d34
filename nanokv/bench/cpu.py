"""CPU benchmark: a fixed seeded batch on the embedded model, nanokv vs HF transformers `generate`.

Workload (seed 0): N prompts of random token ids, lengths uniform in [64, 256]; output lengths
uniform in [32, 128]; greedy, EOS ignored. Throughput = requested output tokens / wall time.
HF runs the same prompts as one left-padded batch with `max_new_tokens` = the longest request
(static batching: it cannot retire rows early), which is how `generate` serves a batch.
"""

from __future__ import annotations

import copy
import random
import time
from typing import Any

import torch


def make_workload(num_seqs: int, seed: int = 0, vocab: int = 49152) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(64, 256))] for _ in range(num_seqs)]
    outs = [rng.randint(32, 128) for _ in range(num_seqs)]
    return prompts, outs


def run_nanokv(engine_kw: dict[str, Any], prompts, outs) -> tuple[float, list[list[int]]]:
    from nanokv.engine.llm import LLM
    from nanokv.sampling import SamplingParams

    kw = {"device": "cpu", **engine_kw}
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

    from nanokv.model.loader import embedded_model_path

    path = embedded_model_path()
    import os
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    model.eval()
    L = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    M = max(outs)
    with torch.inference_mode():
        model.generate(ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=4, do_sample=False)
        t = time.perf_counter()
        gc = copy.deepcopy(model.generation_config)
        gc.eos_token_id = [-1]  # no token has id -1: every row runs to max_new_tokens, as ignore_eos
        gc.pad_token_id = pad
        gc.max_new_tokens, gc.do_sample = M, False
        gen = model.generate(ids, attention_mask=mask, generation_config=gc)
        dt = time.perf_counter() - t
    return dt, [gen[i, L:L + n].tolist() for i, n in enumerate(outs)]


def run_cpu_bench(engine_kw: dict[str, Any], compare: bool = True, quick: bool = False,
                  num_seqs: int | None = None) -> dict[str, Any]:
    n = num_seqs or (4 if quick else 16)
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
