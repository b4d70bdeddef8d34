"""The adaptive controller through the three services on the GPU (python -m nanokv_tools.bench.gpu_adaptive_split).

Three checks, each through cache + compute processes with the pool shared by CUDA IPC (the width
check also in one process, where the layers are re-formatted in place):
  pool   fp32, a small pool under a burst: the pool rule grows it through the attach protocol
         (Compute.Repool -> Cache.Attach, a new epoch, CUDA graphs captured again) and shrinks it
         back when idle; greedy tokens == the CPU fp32 reference; seconds per repool.
  width  bf16, every layer int4, an error bound below what int4 and int8 measure: the KV-width
         rule widens the layers through the same protocol; the requests finish; what it measured.
  policy bf16, a scan over documents larger than the pool between hits on a hot prefix: the
         policy rule switches the cache service's policy (Cache.SetPolicy, warm from its ghost);
         milliseconds per GhostWindow call.
In process also the width rule's memory refusal on a device filled up to the margin (CUDA only).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any


def _timed(obj: Any, name: str, into: list[float], after: Any = None) -> None:
    """Wrap obj.name so that each call's seconds land in `into` (the controller calls it by name);
    after(): called after each call."""
    fn = getattr(obj, name)

    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            into.append(time.perf_counter() - t0)
            if after is not None:
                after()
    setattr(obj, name, wrapper)


def _split(kw: dict[str, Any]) -> Any:
    from nanokv.config import EngineConfig
    from nanokv.launch import start_services

    return start_services(EngineConfig.from_kwargs(**kw).to_dict())


def check_pool(model: str, prompts: list[list[int]], device: str) -> dict[str, Any]:
    from nanokv.gateway.adaptive.settings import PATIENCE_WINDOWS
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    p = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    common: dict[str, Any] = dict(model=model, max_model_len=1024, block_size=16, dtype="float32")
    cpu = LLM(device="cpu", attention_backend="torch", batch_invariant=False, num_gpu_blocks=256, **common)
    want = [o.token_ids for o in cpu.generate(prompts, p, use_tqdm=False)]
    del cpu
    # the reserve caps the growth at 1 GiB (on CUDA the device's free memory also counts)
    kw: dict[str, Any] = dict(common, device=device, num_gpu_blocks=48, adaptive=True, adaptive_window_steps=4,
              adaptive_pool_grow_fraction=1.0, adaptive_pool_reserve_bytes=1 << 30)
    repools: list[float] = []
    with _split(kw) as svc:
        llm = LLM(cache_address=svc.cache_address, compute_address=svc.compute_address, **kw)
        eng = llm.engine
        sizes: list[int] = []
        _timed(eng, "repool", repools, lambda: sizes.append(eng.num_blocks))
        t0 = time.perf_counter()
        got = [o.token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
        run_s = time.perf_counter() - t0
        grown = max(sizes, default=48)  # (the pool may shrink again before the run ends: its tail is idle)
        for _ in range(kw["adaptive_window_steps"] * (PATIENCE_WINDOWS + 1)):  # idle windows: it shrinks back
            eng.tick_idle()
        stats = eng.stats()
        res = {"identical_to_cpu_reference": f"{sum(a == b for a, b in zip(got, want))}/{len(prompts)}",
               "grows": stats["adaptations"].get("pool_grow", 0), "shrinks": stats["adaptations"].get("pool_shrink", 0),
               "blocks_start": 48, "blocks_largest": grown, "sizes": sizes, "blocks_end": stats["kv_blocks_total"],
               "preemptions": stats["preemptions"], "repool_s": repools, "run_s": run_s,
               "blocks_left_in_use": stats["kv_cache_usage"]}
        eng.shutdown()
    print(f"[adaptive split pool fp32] greedy == CPU reference {res['identical_to_cpu_reference']}; pool 48 -> "
          f"{grown} blocks at most ({res['grows']} grows) -> {res['blocks_end']} at the end "
          f"({res['shrinks']} shrinks); "
          f"{res['preemptions']} preemptions; "
          f"repools {', '.join(f'{1e3 * s:.0f}' for s in repools)} ms")
    return res


def _width_kw(model: str, device: str) -> dict[str, Any]:
    """bf16, every layer int4, an error bound below what any width measures: the rule widens all."""
    return dict(model=model, max_model_len=1024, num_gpu_blocks=256, block_size=32, device=device, dtype="bfloat16",
                enable_compression=True, quantization_bitwidth=4, adaptive=True, adaptive_window_steps=4,
                adaptive_compression_error_bound=1e-6)


def check_width(model: str, prompts: list[list[int]], device: str) -> dict[str, Any]:
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    p = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    kw = _width_kw(model, device)
    repools: list[float] = []
    with _split(kw) as svc:
        llm = LLM(cache_address=svc.cache_address, compute_address=svc.compute_address, **kw)
        eng = llm.engine
        before = list(eng.model_info.layer_bits)
        _timed(eng, "repool", repools)
        outs = llm.generate(prompts, p, use_tqdm=False)
        ctl = eng.controller
        errors = {layer: round(e, 4) for layer, e in sorted(ctl.logit_error.items())}
        res = {"bits_before": before, "bits_after": list(eng.compute.info().layer_bits),
               "finished": f"{sum(len(o.token_ids) == 32 for o in outs)}/{len(prompts)}",
               "kv_bits_decisions": [(d.step, d.action, d.applied, d.note) for d in ctl.decisions
                                     if d.kind == "kv_bits"],
               "logit_error_at_current_width": errors, "repool_s": repools,
               "blocks_left_in_use": eng.stats()["kv_cache_usage"]}
        eng.shutdown()
    print(f"[adaptive split width bf16] layers {sorted(set(before))} -> {sorted(set(res['bits_after']))} bits in "
          f"{len(res['kv_bits_decisions'])} decisions; finished {res['finished']}; repools "
          f"{', '.join(f'{1e3 * s:.0f}' for s in repools)} ms")
    return res


def check_width_in_process(model: str, prompts: list[list[int]], device: str) -> dict[str, Any]:
    """The same width check with the services in this process: the rule re-formats the layers in
    place (KVPool.reformat_kv) and the runner captures its CUDA graphs again; seconds per re-format."""
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    p = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(**_width_kw(model, device))
    eng = llm.engine
    before = list(eng.runner.layer_bits)
    reformats: list[float] = []
    _timed(eng.runner, "reformat_kv", reformats)
    outs = llm.generate(prompts, p, use_tqdm=False)
    res = {"bits_before": before, "bits_after": list(eng.runner.layer_bits),
           "finished": f"{sum(len(o.token_ids) == 32 for o in outs)}/{len(prompts)}",
           "graphs_captured": eng.runner.graphs is not None or device != "cuda",
           "kv_bits_decisions": [(d.step, d.action, d.applied, d.note) for d in eng.controller.decisions
                                 if d.kind == "kv_bits"],
           "reformat_s": reformats, "blocks_left_in_use": eng.stats()["kv_cache_usage"],
           # every layer moved out of the start-up segment: the cache service freed it
           "segment_freed": eng.local_cache.storage is None}
    eng.shutdown()
    print(f"[adaptive in-process width bf16] layers {sorted(set(before))} -> {sorted(set(res['bits_after']))} bits "
          f"in {len(res['kv_bits_decisions'])} decisions; finished {res['finished']}; graphs "
          f"{'captured again' if res['graphs_captured'] else 'MISSING'}; start-up segment "
          f"{'freed' if res['segment_freed'] else 'KEPT'}; re-formats "
          f"{', '.join(f'{1e3 * s:.0f}' for s in reformats)} ms")
    return res


def check_width_refusal(model: str, prompts: list[list[int]], device: str) -> dict[str, Any]:
    """The width rule's memory check on a nearly full device, in process: a tensor takes the free
    memory down to adaptive_pool_margin_bytes plus ~5.5 layers' 16-bit size, so the rule widens a few
    layers and refuses the rest; every request must still finish, with the margin left for the forward
    passes and graph captures, and the start-up segment stays (some layers still view it). CUDA only."""
    if device != "cuda":
        return {"skipped": "the memory check runs on CUDA only"}
    import torch

    from nanokv.gateway.llm import LLM
    from nanokv.kv.cache import bytes_per_block
    from nanokv.sampling import SamplingParams

    llm = LLM(**dict(_width_kw(model, device), num_gpu_blocks=2048))
    eng = llm.engine
    r, c = eng.runner, eng.runner.kv_caches[0]
    layer = c.num_blocks * bytes_per_block(16, c.num_kv_heads, c.block_size, int(r.head_dim), r.dtype)
    margin = eng.config.adaptive_pool_margin_bytes
    torch.cuda.empty_cache()
    hog = torch.empty(max(0, torch.cuda.mem_get_info()[0] - margin - int(5.5 * layer)), dtype=torch.uint8,
                      device="cuda")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    bits = list(r.layer_bits)
    res = {"layer_mib_at_16_bits": layer / 2**20, "margin_mib": margin / 2**20, "bits_after": bits,
           "widened": sum(b == 16 for b in bits), "kept_int4": sum(b == 4 for b in bits),
           "finished": f"{sum(len(o.token_ids) == 32 for o in outs)}/{len(prompts)}",
           "adaptations": eng.stats()["adaptations"], "segment_kept": eng.local_cache.storage is not None,
           "free_mib_at_end": torch.cuda.mem_get_info()[0] / 2**20}
    del hog
    eng.shutdown()
    print(f"[adaptive in-process width refusal bf16] {res['widened']} layers widened, {res['kept_int4']} kept int4 "
          f"(layer {res['layer_mib_at_16_bits']:.0f} MiB at 16 bits, margin {res['margin_mib']:.0f} MiB); finished "
          f"{res['finished']}; {res['free_mib_at_end']:.0f} MiB free at the end; start-up segment "
          f"{'kept' if res['segment_kept'] else 'FREED'}")
    return res


def check_policy(model: str, device: str, vocab: int) -> dict[str, Any]:
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    rng = random.Random(1)
    docs = [[rng.randrange(0, vocab) for _ in range(80)] for _ in range(6)]  # 5 blocks each: 30 > the pool
    hot = [rng.randrange(0, vocab) for _ in range(48)]
    prompts = [q for r in range(8) for i, d in enumerate(docs) for q in (d + [10 + r, 11 + i], hot + [20 + r, 30 + i])]
    p = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    kw: dict[str, Any] = dict(model=model, max_model_len=1024, num_gpu_blocks=24, block_size=16, device=device,
              dtype="bfloat16", eviction_policy="adaptive", adaptive_window_steps=4)
    windows: list[float] = []
    with _split(kw) as svc:
        llm = LLM(cache_address=svc.cache_address, compute_address=svc.compute_address, **kw)
        eng = llm.engine
        _timed(eng.cache, "ghost_window", windows)
        for q in prompts:
            llm.generate([q], p, use_tqdm=False)
        stats = eng.stats()
        res = {"policy_decisions": [(d.step, d.action, d.applied) for d in eng.controller.decisions
                                    if d.kind == "eviction_policy"],
               "live_policy": stats["eviction_policy"], "prefix_hits_tokens": stats["prefix_hits_tokens"],
               "ghost_window_ms": [1e3 * s for s in windows]}
        eng.shutdown()
    ms = sorted(res["ghost_window_ms"])
    print(f"[adaptive split policy bf16] {res['policy_decisions']}; live policy {res['live_policy']}; "
          f"GhostWindow median {ms[len(ms) // 2]:.2f} ms over {len(ms)} windows")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--out", default="adaptive_split.json")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model on the CPU (checks the script)")
    args = ap.parse_args(argv)
    model, device, vocab = ("random:tiny-qwen3", "cpu", 500) if args.smoke else (args.model, "cuda", 10000)
    rng = random.Random(0)
    prompts = [[rng.randrange(0, vocab) for _ in range(rng.randint(40, 300))] for _ in range(12)]
    res = {"pool": check_pool(model, prompts, device), "width": check_width(model, prompts, device),
           "width_in_process": check_width_in_process(model, prompts, device),
           "width_refusal": check_width_refusal(model, prompts, device),
           "policy": check_policy(model, device, vocab)}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
