"""CPU single-stream decode: nanokv `LLM().generate` vs llama.cpp (llama-cpp-python) on the same GGUF.

`nanokv bench --workload cpu-stream --compare llama.cpp [--threads 2]`. One fixed ~200-word prompt
(raw text, no chat template), tokenized once by nanokv's tokenizer; both engines get the same token
ids (same count, reported), greedy, exactly 128 new tokens (EOS ignored), prefix caches off (every
run prefills the whole prompt). Three runs each, alternating nanokv / llama.cpp, after one warm-up
each (--quick: 32 new tokens, two runs each). The 1-minute load average before and after is
recorded: the box may be shared, so the ratio of the two engines is the figure to read.
Reported per run and as the median:
  decode tok/s      = (new tokens - 1) / (last token time - first token time): the per-token loop;
  end-to-end tok/s  = new tokens / wall time of the whole generate call (prefill included).
llama-cpp-python is a benchmark-only dependency (pip install -e 'tools[cpu-peer]').
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

NEW_TOKENS = 128
RUNS = 3
QUICK = (32, 2)  # --quick: new tokens, runs (a smoke run, or a box too loaded for the full one)
PROMPT = (
    "The old lighthouse stood at the edge of the northern cliffs for more than two hundred years. "
    "Its keepers kept careful logs of every storm, every ship that passed in the night, and every "
    "small repair they made to the great lamp at the top of the tower. In the early years the lamp "
    "burned whale oil, and the keeper climbed the narrow stairs four times each night to trim the "
    "wicks and clean the soot from the glass. Later the oil gave way to kerosene, and later still to "
    "electric light, but the logs continued in the same plain handwriting, page after page. The "
    "village below the cliffs grew from a handful of fishing families into a busy harbour town with "
    "a school, two churches, a market square and a railway station. Children were told stories "
    "about the keepers, about the winter when the sea froze near the rocks, and about the night a "
    "merchant ship lost its way in the fog and was saved only because the keeper rang the bell by "
    "hand for nine hours. When the lighthouse was finally automated, the last keeper packed his "
    "books into wooden crates and gave them to the town library, where they remain today. Write a "
    "short summary of this history and explain why the logs might matter to historians."
)


def _nanokv_run(llm: Any, ids: list[int], new_tokens: int) -> dict[str, Any]:
    from nanokv.sampling import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([ids], sp, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    m, n = out.metrics, len(out.token_ids)
    return {"tokens": n, "wall_s": wall, "decode_tok_s": (n - 1) / (m.finish_time - m.first_token_time),
            "e2e_tok_s": n / wall, "token_ids": list(out.token_ids)}


def _llamacpp_run(llm: Any, ids: list[int], new_tokens: int) -> dict[str, Any]:
    llm.reset()  # forget the previous run's tokens: no prefix reuse, the prompt is prefilled again
    n, first = 0, 0.0
    toks: list[int] = []
    t0 = time.perf_counter()
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        n += 1
        toks.append(int(tok))
        if n == 1:
            first = time.perf_counter()
        if n == new_tokens:  # EOS ignored: stop only at the count
            break
    end = time.perf_counter()
    return {"tokens": n, "wall_s": end - t0, "decode_tok_s": (n - 1) / (end - first), "e2e_tok_s": n / (end - t0),
            "token_ids": toks}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs],
            "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in runs),
            "e2e_tok_s_median": statistics.median(r["e2e_tok_s"] for r in runs)}


def run_cpu_stream_bench(engine_kw: dict[str, Any], compare: bool, quick: bool = False) -> dict[str, Any]:
    from nanokv.compute_service.model.loader import embedded_model_path, resolve_model_path
    from nanokv.gateway.llm import LLM

    threads = torch.get_num_threads()
    new_tokens, runs = QUICK if quick else (NEW_TOKENS, RUNS)
    kw = {"device": "cpu", "enable_prefix_caching": False, "max_num_seqs": 1, **engine_kw}
    llm = LLM(**kw)
    ids = llm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    path = resolve_model_path(kw.get("model"))[1] if kw.get("model") else embedded_model_path()
    peer = None
    if compare:
        try:
            from llama_cpp import Llama
        except ImportError:
            raise SystemExit("--compare llama.cpp needs llama-cpp-python: pip install -e 'tools[cpu-peer]'") from None
        peer = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512,
                     verbose=False)
    load_before = os.getloadavg()
    _nanokv_run(llm, ids, new_tokens)  # warm-up (first-call allocations, kernel selection)
    if peer is not None:
        _llamacpp_run(peer, ids, new_tokens)
    nano_runs, peer_runs = [], []
    for _ in range(runs):
        nano_runs.append(_nanokv_run(llm, ids, new_tokens))
        if peer is not None:
            peer_runs.append(_llamacpp_run(peer, ids, new_tokens))
    from nanokv.compute_service.model.loader import resolve_weight_quantization

    wq = resolve_weight_quantization(kw.get("weight_quantization", "none"), resolve_model_path(kw.get("model"))[0],
                                     "cpu", 1)
    result: dict[str, Any] = {
        "workload": "cpu-stream", "model_path_name": path.rsplit("/", 1)[-1], "prompt_words": len(PROMPT.split()),
        "prompt_tokens": len(ids), "new_tokens": new_tokens, "runs": runs, "torch_threads": threads,
        "weight_quantization": wq, "nanokv": _summary(nano_runs),
        # the box is shared: other jobs' load (1-minute average) before and after the runs
        "load_average_1m": [load_before[0], os.getloadavg()[0]],
    }
    n = result["nanokv"]
    print(f"prompt: {len(PROMPT.split())} words = {len(ids)} tokens (the same ids to both); {new_tokens} new "
          f"tokens, greedy, EOS ignored; {threads} threads; weight_quantization={wq}; load average "
          f"{result['load_average_1m'][0]:.1f} -> {result['load_average_1m'][1]:.1f}")
    print("decode tok/s = (new - 1) / (last - first token time); end-to-end tok/s = new / wall (prefill included)")
    print(f"nanokv:    decode {n['decode_tok_s_median']:.1f} tok/s, end-to-end {n['e2e_tok_s_median']:.1f} tok/s "
          f"(median of {runs}: " + ", ".join(f"{r['decode_tok_s']:.1f}" for r in nano_runs) + ")")
    if peer is not None:
        result["llama_cpp"] = p = _summary(peer_runs)
        import llama_cpp

        result["llama_cpp"]["version"] = llama_cpp.__version__
        same = sum(a == b for a, b in zip(nano_runs[0]["token_ids"], peer_runs[0]["token_ids"]))
        result["same_tokens_as_llama_cpp"] = same
        result["ratio_decode"] = n["decode_tok_s_median"] / p["decode_tok_s_median"]
        result["ratio_e2e"] = n["e2e_tok_s_median"] / p["e2e_tok_s_median"]
        print(f"llama.cpp: decode {p['decode_tok_s_median']:.1f} tok/s, end-to-end {p['e2e_tok_s_median']:.1f} "
              f"tok/s (median of {runs}: " + ", ".join(f"{r['decode_tok_s']:.1f}" for r in peer_runs) + ")")
        print(f"nanokv / llama.cpp: decode {result['ratio_decode']:.2f}x, end-to-end {result['ratio_e2e']:.2f}x; "
              f"greedy tokens equal to llama.cpp's: {same}/{new_tokens} (different arithmetic: not expected "
              "to match throughout)")
    llm.engine.shutdown()
    return result
