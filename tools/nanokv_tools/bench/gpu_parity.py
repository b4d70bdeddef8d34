"""GPU vs CPU-reference parity on the same random-weight model (python -m nanokv_tools.bench.gpu_parity).

fp32 on both sides: the Triton path (CUDA graphs on) must produce the CPU torch path's greedy
tokens exactly. bf16 on the GPU: report top-1 agreement and the logit error against fp32, since
bf16 rounding legitimately flips near-ties.
"""

from __future__ import annotations

import argparse
import json
import random

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default="parity.json")
    ap.add_argument("--bits", type=int, default=16, choices=(16, 8, 4), help="KV cache format on both sides")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="GPU model dtypes to compare (comma list)")
    ap.add_argument("--split", action="store_true",
                    help="also through the three services (gRPC, pool by CUDA IPC): == in-process, token for token")
    args = ap.parse_args(argv)

    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(0, 10000) for _ in range(rng.randint(40, 300))] for _ in range(args.num_prompts)]
    p = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=1)
    common: dict = dict(model=args.model, max_model_len=1024, num_gpu_blocks=256, block_size=16)
    if args.bits < 16:
        common.update(enable_compression=True, quantization_bitwidth=args.bits)
    res: dict = {}
    # batch_invariant off: the torch reference with the GPU kernels' read rule for int4 blocks
    cpu = LLM(device="cpu", dtype="float32", attention_backend="torch", batch_invariant=False, **common)
    ref = cpu.generate(prompts, p, use_tqdm=False)
    del cpu
    for dtype in args.dtypes.split(","):
        gpu = LLM(device="cuda", dtype=dtype, attention_backend="triton", **common)
        outs = gpu.generate(prompts, p, use_tqdm=False)
        # second pass: the prompts now hit the prefix cache (paged prefill over a cached prefix)
        outs2 = gpu.generate(prompts, p, use_tqdm=False)
        same = sum(a.token_ids == b.token_ids for a, b in zip(ref, outs))
        same2 = sum(a.token_ids == b.token_ids for a, b in zip(ref, outs2))
        agree = []
        for a, b in zip(ref, outs):
            n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
            agree.append(n)
        lp_err = max(abs(a.logprobs[0]["logprob"] - b.logprobs[0]["logprob"])  # type: ignore[index]
                     for a, b in zip(ref, outs))
        split = _split_parity(dict(device="cuda", dtype=dtype, attention_backend="triton", **common), prompts,
                              gpu) if args.split else {}
        res[dtype] = split | {"identical_sequences": f"{same}/{len(prompts)}",
                      "identical_with_prefix_hits": f"{same2}/{len(prompts)}",
                      "tokens_before_first_divergence": agree,
                      "first_token_logprob_max_abs_diff": lp_err,
                      "cuda_graphs": gpu.engine.runner.graphs is not None}
        print(f"[parity {dtype} kv{args.bits}] identical greedy sequences vs CPU fp32 reference: "
              f"{same}/{len(prompts)}"
              f" (with prefix hits {same2}/{len(prompts)}); first divergence at {agree};"
              f" first-token logprob max |diff| {lp_err:.2e}")
        if split:
            print(f"[parity {dtype} kv{args.bits} split] three processes == in-process: "
                  f"{split['split_identical_to_in_process']} (async, placeholders fed on the device), "
                  f"{split['split_identical_with_logprobs']} (logprobs, synchronous); vs CPU fp32 reference "
                  f"{split['split_identical_to_cpu_reference']}; with a repool mid-run == in-process repool "
                  f"{split['split_repool_identical_to_in_process_repool']}, == CPU reference "
                  f"{split['split_repool_identical_to_cpu_reference']}")
        del gpu
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    return 0


def _split_parity(kw: dict, prompts: list[list[int]], local) -> dict:  # noqa: ANN001 - an LLM
    """The same prompts through cache + compute processes (the pool shared by CUDA IPC), greedy with
    and without logprobs, against the in-process engine `local` and against the CPU reference."""
    from nanokv.config import EngineConfig
    from nanokv.gateway.llm import LLM
    from nanokv.launch import start_services
    from nanokv.sampling import SamplingParams

    n = len(prompts)
    fast = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    slow = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    local.engine.reset_counters()
    want_fast = [o.token_ids for o in local.generate(prompts, fast, use_tqdm=False)]
    want_slow = [o.token_ids for o in local.generate(prompts, slow, use_tqdm=False)]
    cpu_ref = LLM(device="cpu", dtype="float32", attention_backend="torch", batch_invariant=False,
                  **{k: v for k, v in kw.items() if k not in ("device", "dtype", "attention_backend")})
    want_cpu = [o.token_ids for o in cpu_ref.generate(prompts, fast, use_tqdm=False)]
    del cpu_ref
    with start_services(EngineConfig.from_kwargs(**kw).to_dict()) as svc:
        llm = LLM(cache_address=svc.cache_address, compute_address=svc.compute_address, **kw)
        got_fast = [o.token_ids for o in llm.generate(prompts, fast, use_tqdm=False)]
        got_slow = [o.token_ids for o in llm.generate(prompts, slow, use_tqdm=False)]
        epoch = llm.engine.model_info.epoch
        got_repool, repool_s = _generate_with_repool(llm.engine, prompts, fast)
        repool_epoch = llm.engine.model_info.epoch
        llm.engine.shutdown()
    # a fresh in-process engine: the long-lived one has served other runs (the split's engine is fresh too)
    fresh = LLM(**kw)
    want_repool, _ = _generate_with_repool(fresh.engine, prompts, fast)
    fresh.engine.shutdown()
    del fresh
    print(f"[parity split repool] pool 256 -> 192 blocks after 8 steps over CUDA IPC: {1e3 * repool_s:.0f} ms, "
          f"epoch {epoch} -> {repool_epoch}")
    same_repool = sum(a == b for a, b in zip(got_repool, want_repool))
    return {"split_repool_identical_to_in_process_repool": f"{same_repool}/{n}",
            "split_repool_identical_to_cpu_reference": f"{sum(a == b for a, b in zip(got_repool, want_cpu))}/{n}",
            "split_repool_ms": 1e3 * repool_s, "split_repool_epoch_moved": repool_epoch > epoch,
            "split_identical_to_in_process": f"{sum(a == b for a, b in zip(got_fast, want_fast))}/{n}",
            "split_identical_with_logprobs": f"{sum(a == b for a, b in zip(got_slow, want_slow))}/{n}",
            "split_identical_to_cpu_reference": f"{sum(a == b for a, b in zip(got_fast, want_cpu))}/{n}"}


def _generate_with_repool(engine, prompts: list[list[int]], params) -> tuple[list[list[int]], float]:  # noqa: ANN001
    """Greedy generation with a pool change (256 -> 192 blocks) after 8 steps: the requests in flight
    are recomputed on the new pool. Returns the tokens in prompt order and the repool's seconds."""
    import time

    engine.reset_counters()  # both transports start from an empty prefix cache (hits change bf16 sums)
    for i, p in enumerate(prompts):
        engine.add_request(f"repool-{i}", p, params)
    done: dict[str, list[int]] = {}
    steps, took = 0, 0.0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        if steps == 8:
            t0 = time.perf_counter()
            outs += engine.repool(num_blocks=192)
            took = time.perf_counter() - t0
        done.update({o.request_id: list(o.token_ids) for o in outs if o.finished})
    engine.repool(num_blocks=256)
    return [done[f"repool-{i}"] for i in range(len(prompts))], took


if __name__ == "__main__":
    raise SystemExit(main())
