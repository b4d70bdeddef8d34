"""Triton KV kernels on a GPU: correctness at real shapes, then paged decode bandwidth vs dense SDPA.

  python -m nanokv_tools.bench.gpu_kernels --out DIR          (CUDA; needs only torch + triton)
  python -m nanokv_tools.bench.gpu_kernels --smoke --out DIR  (CPU, TRITON_INTERPRET=1, tiny shapes)

Checks: fresh random inputs per check, outputs NaN-poisoned first, relative error against a float64
reference on the same cache contents. Timing: CUDA graphs of 20 calls over rotated inputs (no launch
gaps), median of 10 replays. Bytes counted: K/V codes + scales, each read once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanokv.kernels import triton_decode  # noqa: E402
from nanokv.kernels.triton_backend import TritonBackend, choose_splits, decode_options, sm_count  # noqa: E402
from nanokv.kernels.triton_config import TritonConfig  # noqa: E402
from nanokv.kernels.triton_selfcheck import Shapes, check_all, check_variants, make_batch  # noqa: E402
from nanokv.kv.cache import LayerKV  # noqa: E402
from nanokv.kv.metadata import AttentionMetadata  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
DT = torch.float16 if SMOKE else torch.bfloat16  # the interpreter mishandles bf16 dots
H, G, D = (2, 2, 32) if SMOKE else (8, 2, 128)  # Qwen3-0.6B: 16 q heads, 8 kv heads, dim 128
SCALE = D ** -0.5
RESULTS: dict = {"checks": [], "bench": [], "sweep": [], "errors": []}
SDPA_MS: dict[tuple[int, int], float] = {}  # (B, ctx) -> dense SDPA decode ms
SH = Shapes(DEV, DT, H, G, D, SMOKE, RESULTS["checks"])
T0 = time.time()


def timed(fn: Callable[[int], object]) -> float:
    """Median ms of one fn(i) call; i rotates the inputs. CUDA: a graph of 20 calls, 10 replays."""
    if DEV.type != "cuda":
        fn(0)
        t = time.perf_counter()
        fn(1)
        return (time.perf_counter() - t) * 1e3
    for i in range(3):  # compile, warm up, grow the cached split-K scratch before capture
        fn(i)
    torch.cuda.synchronize()
    reps, graph = 20, torch.cuda.CUDAGraph()
    run_graph = True
    try:
        with torch.cuda.graph(graph):
            for i in range(reps):
                fn(i)
    except Exception as e:  # not capturable: time plain launches (launch gaps included)
        RESULTS["errors"].append(f"graph capture failed, timing eagerly: {type(e).__name__}: {e}"[:300])
        torch.cuda.synchronize()
        run_graph = False

    def run() -> None:
        if run_graph:
            graph.replay()
        else:
            for i in range(reps):
                fn(i)

    run()
    times = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / reps)
    return statistics.median(times)


def kv_bytes(bits: int, tokens: int) -> int:
    """K and V bytes read for `tokens` tokens: codes plus per-(token, head) scales/zeros."""
    code = {16: 2 * D, 8: D, 4: D // 2}[bits]
    return tokens * 2 * H * (code + {16: 0, 8: 2, 4: 4}[bits])


def bench_row(name: str, ms: float, nbytes: int = 0, flops: float = 0.0, **kw) -> dict:
    row = {"name": name, "ms": ms, "GB/s": nbytes / ms / 1e6, "TFLOP/s": flops / ms / 1e9, **kw}
    RESULTS["bench"].append(row)
    print(f"bench {name:52s} {ms * 1e3:9.1f} us {row['GB/s']:7.0f} GB/s {row['TFLOP/s']:6.1f} TFLOP/s",
          flush=True)
    return row


def decode_shapes() -> list[tuple[int, int]]:
    return [(2, 64), (4, 32)] if SMOKE else [(64, 4096), (256, 1024)]


def decode_fn(cache: LayerKV, md: AttentionMetadata, cfg: TritonConfig,
              fill: torch.Tensor | None = None) -> Callable[[int], object]:
    """A decode call on fresh queries; fill: the step's slots, for the int4 kernel that also quantizes
    the blocks they complete (the same blocks again on every call: what it writes does not change)."""
    B = md.num_seqs
    qs = [torch.randn(B, H * G, D, device=DEV, dtype=DT) for _ in range(4)]
    out = torch.empty_like(qs[0])
    splits = choose_splits(cfg, B, H, md.max_seq_len, sm_count(DEV), cache.bits, cache.block_size)
    kw = decode_options(cfg, cache)
    # as the engine: one argsort per step (here: once), read by every layer's int4 decode
    order = md.decode_order() if cache.bits == 4 and cfg.quant_cuda4_by_length else None

    def call(i: int) -> torch.Tensor:
        triton_decode.paged_decode(qs[i % 4], cache, md.block_tables, md.seq_lens, out, SCALE, num_splits=splits,
                                   seq_order=order, fill_slots=fill if cfg.quant_cuda4_fill else None, **kw)
        return out  # (written in place)
    return call


def bench_copy() -> None:
    """Copy bandwidth (bytes read + written): in a graph (a memcpy node) and as eager kernels."""
    src = torch.randn((1 << 20) if SMOKE else (1 << 30), device=DEV)
    dst = torch.empty_like(src)
    bench_row("device copy (read + write), graph", timed(lambda i: dst.copy_(src)), 2 * src.numel() * 4)
    if DEV.type == "cuda":
        import triton.testing
        ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
        bench_row("device copy (read + write), do_bench", ms, 2 * src.numel() * 4)
        ms = triton.testing.do_bench(lambda: torch.mul(src, 1.0, out=dst), return_mode="median")
        bench_row("device elementwise x*1 (read + write), do_bench", ms, 2 * src.numel() * 4)


def bench_decode() -> None:
    """Dense SDPA and default-config paged decode per format and block size. vs_sdpa = SDPA time / ours."""
    for B, ctx in decode_shapes():
        kd, vd = (torch.randn(B, H, ctx, D, device=DEV, dtype=DT) for _ in range(2))
        qs = [torch.randn(B, H * G, 1, D, device=DEV, dtype=DT) for _ in range(4)]

        def sdpa(i: int, kd: torch.Tensor = kd, vd: torch.Tensor = vd, qs: list[torch.Tensor] = qs) -> object:
            return F.scaled_dot_product_attention(qs[i % 4], kd, vd, enable_gqa=True)
        ms = timed(sdpa)
        SDPA_MS[(B, ctx)] = bench_row(f"sdpa dense decode B={B} ctx={ctx}", ms, kv_bytes(16, B * ctx))["ms"]
        del kd, vd
        for bits in (16, 8, 4):
            cache, md = make_batch(SH, bits, 16, [1] * B, [ctx] * B, 0, store=False)
            splits = choose_splits(TritonConfig(), B, H, ctx, sm_count(DEV), bits)
            ms = timed(decode_fn(cache, md, TritonConfig()))
            row = bench_row(f"triton decode bits={bits} B={B} ctx={ctx}", ms, kv_bytes(bits, B * ctx),
                            splits=splits)
            row["vs_sdpa"] = SDPA_MS[(B, ctx)] / row["ms"]
    B, ctx = decode_shapes()[0]
    for bs in (8, 32) if SMOKE else (8, 32, 64, 256):  # any power-of-2 block size, same tiles
        cache, md = make_batch(SH, 16, bs, [1] * B, [ctx] * B, 0, store=False)
        ms = timed(decode_fn(cache, md, TritonConfig()))
        row = bench_row(f"triton decode bits=16 B={B} ctx={ctx} bs={bs}", ms, kv_bytes(16, B * ctx))
        row["vs_sdpa"] = SDPA_MS[(B, ctx)] / row["ms"]


def bench_prefill() -> None:
    """P prompts of L tokens: fresh (vs dense causal SDPA) and half-cached; a few tile configs."""
    P, L = (2, 40) if SMOKE else (8, 2048)
    kd, qd = torch.randn(P, H, L, D, device=DEV, dtype=DT), torch.randn(P, H * G, L, D, device=DEV, dtype=DT)
    ms = timed(lambda i: F.scaled_dot_product_attention(qd, kd, kd, is_causal=True, enable_gqa=True))
    bench_row(f"sdpa causal prefill {P}x{L}", ms, flops=4 * P * H * G * D * L * (L + 1) / 2)
    configs = [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2),
               (64, 64, 4, 3)][:1 if SMOKE else None]
    for bits in (16, 8, 4):
        for cached in (0, L // 2):
            cache, md = make_batch(SH, bits, 16, [L - cached] * P, [L] * P, P, store=False)
            q = torch.randn(md.num_prefill_tokens, H * G, D, device=DEV, dtype=DT)
            out = torch.empty_like(q)
            fl = 4 * P * H * G * D * sum(cached + j + 1 for j in range(L - cached))
            for bm, bn, w, st in configs if bits == 16 else configs[:1]:
                be = TritonBackend(TritonConfig(prefill_block_m=bm, prefill_block_n=bn, prefill_warps=w,
                                                prefill_stages=st, sdpa_prefill_min_tokens=0))

                def step(i: int, be: TritonBackend = be, q: torch.Tensor = q, c: LayerKV = cache,
                         md: AttentionMetadata = md, o: torch.Tensor = out) -> object:
                    return be.paged_attention(q, c, md, SCALE, out=o)
                try:
                    ms = timed(step)
                except Exception as e:
                    RESULTS["errors"].append(f"prefill {bm},{bn},{w},{st}: {type(e).__name__}: {e}"[:300])
                    continue
                bench_row(f"triton prefill bits={bits} {P}x{L} cached={cached} cfg={bm},{bn},{w},{st}", ms,
                          flops=fl)
            if bits == 16 and cached == 0:  # the backend's route for fresh prompts: gather + SDPA
                be = TritonBackend()
                ms = timed(lambda i: be.paged_attention(q, cache, md, SCALE, out=out))  # noqa: B023
                bench_row(f"backend prefill (fresh -> sdpa route) {P}x{L}", ms, flops=fl)


# quantized decode (block_n, warps, stages, splits), inline PTX on; the first is the baseline
QUANT_GRID = [(64, 4, 2, 1), (64, 2, 2, 1), (64, 2, 2, 2), (32, 2, 2, 2), (64, 4, 2, 2), (64, 4, 2, 4),
              (128, 4, 2, 2), (64, 4, 3, 2), (32, 1, 2, 4), (64, 2, 3, 2)]
Tile = tuple[int, int, int, int]  # block_n, warps, stages, splits


# A/B variants (TritonConfig overrides) on a few of those tiles; every QUANT_GRID row runs the defaults
VARIANTS: dict[int, list[tuple[Tile, dict[str, Any]]]] = {
    8: [((64, 4, 2, 1), {"quant_fold_v": False}), ((64, 4, 2, 1), {"quant_maxnreg": 96})],
    4: [((64, 4, 2, 1), {"quant_fold_k": False, "quant_fold_v": False}), ((64, 4, 2, 1), {"quant_fold_v": False}),
        ((128, 4, 2, 2), {"quant_maxnreg": 168})]}


def sweep(budget_s: float, bits_list: tuple[int, ...] = (16, 8, 4), variants_only: bool = False) -> None:
    """Decode tile size x warps x pipeline depth x splits (x the quantized-path variants), per shape."""
    bf16 = [(64, 4, 2, 1), (64, 8, 2, 1), (64, 4, 3, 1), (128, 4, 2, 1), (64, 8, 2, 2), (64, 4, 2, 2)]
    for B, ctx in decode_shapes():
        for bits in bits_list:
            cache, md = make_batch(SH, bits, 16, [1] * B, [ctx] * B, 0, store=False)
            base = bf16 if bits == 16 else QUANT_GRID
            if variants_only:  # the default tiles, then the variants
                d = TritonConfig()
                base = [(d.quant_block_n, d.quant_warps, d.quant_stages, d.quant_min_splits)] if bits < 16 else []
            grid: list[tuple[Tile, dict[str, Any]]] = [(c, {}) for c in base] + VARIANTS.get(bits, [])
            for (bn, w, st, splits), over in grid[:2] if SMOKE else grid:
                if time.time() - T0 > budget_s:
                    RESULTS["errors"].append(f"sweep cut at B={B} bits={bits}: time budget")
                    return
                asm = None if bits == 16 or SMOKE else True  # inline PTX: not in the CPU interpreter
                cfg = TritonConfig(decode_block_n=bn, decode_warps=w, decode_stages=st, quant_block_n=bn,
                                   quant_swap_block_n=bn, quant_warps=w, quant_stages=st, decode_splits=splits,
                                   asm=asm, **over)
                try:
                    ms = timed(decode_fn(cache, md, cfg))
                except Exception as e:  # a config that fails to compile (shared memory) is skipped
                    RESULTS["errors"].append(f"sweep {bits},{bn},{w},{st},{splits},{over}: "
                                             f"{type(e).__name__}: {e}"[:300])
                    continue
                gbs = kv_bytes(bits, B * ctx) / ms / 1e6
                row = {"B": B, "ctx": ctx, "bits": bits, "block_n": bn, "warps": w, "stages": st,
                       "splits": splits, "asm": asm, "variant": over,
                       "us": ms * 1e3, "GB/s": gbs, "vs_sdpa": SDPA_MS[(B, ctx)] / ms}
                RESULTS["sweep"].append(row)
                print("sweep", json.dumps(row), flush=True)


def summary() -> None:
    print("\n== summary ==", RESULTS.get("device"))
    for c in RESULTS["checks"]:
        print(f"{c['check']:28s} {c['rel_err']:.2e} {'ok' if c['ok'] else 'FAIL'} {c['extra']}")
    for r in RESULTS["bench"]:
        rate = f"{r['TFLOP/s']:6.1f} TFLOP/s" if r["TFLOP/s"] else f"{r['GB/s']:6.0f} GB/s"
        vs = f" {r['vs_sdpa']:.2f}x sdpa" if "vs_sdpa" in r else ""
        print(f"{r['name']:60s} {r['ms'] * 1e3:9.1f} us {rate}{vs}")
    for B, ctx in SDPA_MS:
        for bits in (16, 8, 4):
            key = (B, ctx, bits)
            rows = [r for r in RESULTS["sweep"] if (r["B"], r["ctx"], r["bits"]) == key]
            for r in sorted(rows, key=lambda r: -r["GB/s"])[:6]:
                print(f"sweep top B={B} ctx={ctx} bits={bits}: bn={r['block_n']} w={r['warps']} "
                      f"st={r['stages']} splits={r['splits']} {r['variant']} {r['us']:.1f} us "
                      f"{r['GB/s']:.0f} GB/s "
                      f"{r['vs_sdpa']:.2f}x sdpa")
    for e in RESULTS["errors"]:
        print("error:", e[:300])
    print(f"total {time.time() - T0:.0f}s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds after which the sweep stops")
    ap.add_argument("--sweep-bits", default="16,8,4", help="cache formats the sweep covers (comma list)")
    ap.add_argument("--variants-only", action="store_true", help="sweep: default tiles and the A/B variants")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--checks-only", action="store_true", help="correctness checks, no timing")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    import triton
    RESULTS["device"] = {"triton": triton.__version__, "torch": torch.__version__,
                         "date": time.strftime("%F %T")}
    if DEV.type == "cuda":
        p = torch.cuda.get_device_properties(DEV)
        RESULTS["device"].update(name=p.name, sms=p.multi_processor_count)
    steps: list[Callable[[], None]] = [
        lambda: check_all(SH), lambda: check_variants(SH), bench_copy, bench_decode,
        *([] if args.skip_prefill else [bench_prefill]),
        lambda: sweep(args.budget, tuple(int(b) for b in args.sweep_bits.split(",")), args.variants_only)]
    if args.checks_only:
        steps = steps[:2]
    for step in steps:
        try:
            step()
        except Exception as e:
            RESULTS["errors"].append(f"{type(e).__name__}: {str(e)[:400]}")
            print("ERROR", RESULTS["errors"][-1], flush=True)
        with open(os.path.join(args.out, "gpu_kernels.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    summary()
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
