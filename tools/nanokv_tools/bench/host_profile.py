"""Host time of a workload's prefill phase, on a GPU: `python -m nanokv_tools.bench.host_profile --bits 8`.

run_breakdown shows the device idle between a prefill step's last copy and the next step's upload
(docs/kernels.md, "Host time"): the host, not the device, sets the pace there. This steps the
engine through the prefill phase (until no request waits) and reports, per step, host time in the
step call and the tokens it ran; then the phase under cProfile, top functions by own time and by
cumulative time. cProfile slows Python about 2x, so its figures rank host costs; the unprofiled pass
gives the real ones.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from nanokv_tools.bench import write_json
from nanokv_tools.bench.gpu import make_workload


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prefill_phase(llm, prompts, params, prof: cProfile.Profile | None) -> dict[str, object]:
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"hp-{prof is not None}-{i}", p, sp)
    _sync()
    steps: list[tuple[float, int]] = []
    waited = [0.0]  # host seconds in Event.synchronize: the host waiting for the device
    sync = torch.cuda.Event.synchronize if torch.cuda.is_available() else None

    def timed_sync(ev: torch.cuda.Event) -> None:
        a = time.perf_counter()
        sync(ev)  # type: ignore[misc]
        waited[0] += time.perf_counter() - a
    if sync is not None:
        torch.cuda.Event.synchronize = timed_sync  # type: ignore[method-assign,assignment]
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    while eng.num_waiting() or any(s.num_uncomputed > 1 for s in eng.scheduler.running):
        a = time.perf_counter()
        eng.step(finished_only=True)
        steps.append((time.perf_counter() - a, eng.counters.last_batch_size))
    if prof is not None:
        prof.disable()
    _sync()
    wall = time.perf_counter() - t0
    if sync is not None:
        torch.cuda.Event.synchronize = sync  # type: ignore[method-assign,assignment]
    for rid in list(eng._seqs):  # the decode phase is not measured here
        eng.abort(rid)
    while eng.has_unfinished_requests():  # the async step still in flight
        eng.step(finished_only=True)
    host = [s for s, _ in steps]
    return {"steps": len(steps), "wall_s": wall, "host_step_s": sum(host), "waited_s": waited[0],
            "host_step_ms_median": sorted(host)[len(host) // 2] * 1e3 if host else 0.0,
            "batch_sizes": [b for _, b in steps]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="longctx")
    ap.add_argument("--bits", type=int, default=16, choices=(16, 8, 4))
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--num-seqs", type=int, default=None)
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--passes", type=int, default=2,
                    help="unprofiled passes; the first meets new shapes (allocator growth, kernel variants)")
    ap.add_argument("--callees", default="paged_attention,after_attention,try_decode,before_store,qk_norm_rope,"
                    "_step_items",
                    help="comma-separated functions whose callees to list (pstats restriction regexes)")
    ap.add_argument("--out", default=None, help="JSON file")
    args = ap.parse_args(argv)
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    quant = dict(enable_compression=True, quantization_bitwidth=args.bits) if args.bits < 16 else {}
    llm = LLM(model=args.model, max_model_len=8192, max_num_batched_tokens=args.max_num_batched_tokens,
              **quant)
    prompts, outs = make_workload(args.workload, args.num_seqs)
    V = llm.engine.model_config.vocab_size  # (random:tiny-llama, for a CPU smoke run, has 1000 ids)
    L = llm.engine.max_model_len
    outs = [min(o, L // 4) for o in outs]
    prompts = [[t % V for t in p][:L - o - 1] for p, o in zip(prompts, outs)]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outs]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
    phases: dict[str, dict[str, object]] = {}
    for i in range(args.passes):
        llm.engine.cache_manager.reset_prefix_cache()
        phases["plain" if i == args.passes - 1 else f"plain{i}"] = _prefill_phase(llm, prompts, params, None)
    llm.engine.cache_manager.reset_prefix_cache()
    prof = cProfile.Profile()
    phases["profiled"] = _prefill_phase(llm, prompts, params, prof)
    res: dict[str, object] = {"workload": args.workload, "bits": args.bits, **phases}
    for key, r in phases.items():
        print(f"[{args.workload} bits {args.bits} {key}] prefill phase: {r['steps']} steps, wall {r['wall_s']:.3f} s,"
              f" host in step() {r['host_step_s']:.3f} s (median {r['host_step_ms_median']:.2f} ms), of which waiting"
              f" for the device {r['waited_s']:.3f} s")
    tables = {}
    for sort in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(args.top)
        tables[sort] = s.getvalue()
        print(f"--- by {sort}")
        print("\n".join(line[:160] for line in s.getvalue().splitlines()[6:]))
    for name in filter(None, args.callees.split(",")):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_callees(name)
        tables[f"callees {name}"] = s.getvalue()
        print(f"--- callees of {name}")
        print("\n".join(line[:200] for line in s.getvalue().splitlines()[2:60]))
    res["cprofile"] = tables
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
