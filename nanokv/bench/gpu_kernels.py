"""Triton KV kernels on a GPU: correctness at real shapes, then paged decode bandwidth vs dense SDPA.

  python -m nanokv.bench.gpu_kernels --out DIR          (CUDA; needs only torch + triton)
  python -m nanokv.bench.gpu_kernels --smoke --out DIR  (CPU, TRITON_INTERPRET=1, tiny shapes)

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

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanokv.attention.metadata import AttentionMetadata  # noqa: E402
from nanokv.kernels import reference, triton_decode, triton_store  # noqa: E402
from nanokv.kernels.triton_backend import TritonBackend, TritonConfig, choose_splits, sm_count  # noqa: E402
from nanokv.kv.cache import LayerKVCache, allocate_layer_cache  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
DT = torch.float16 if SMOKE else torch.bfloat16  # the interpreter mishandles bf16 dots
H, G, D = (2, 2, 32) if SMOKE else (8, 2, 128)  # Qwen3-0.6B: 16 q heads, 8 kv heads, dim 128
SCALE = D ** -0.5
RESULTS: dict = {"checks": [], "bench": [], "sweep": [], "errors": []}
SDPA_MS: dict[tuple[int, int], float] = {}  # (B, ctx) -> dense SDPA decode ms
T0 = time.time()


def make_batch(bits: int, bs: int, q_lens: list[int], seq_lens: list[int], num_prefills: int,
               holes: float = 0.0, store: bool = True) -> tuple[LayerKVCache, AttentionMetadata]:
    """Scattered block tables; blocks wholly before a sequence's first query token are dropped with
    probability `holes`. store: K/V written by the Triton store, else random codes (timing only)."""
    nbs = [-(-L // bs) for L in seq_lens]
    N = sum(nbs) + 1
    cache = allocate_layer_cache(bits, N, H, bs, D, DT, DEV)
    perm = torch.randperm(N, device=DEV)
    tables = torch.full((len(seq_lens), max(nbs)), -1, dtype=torch.int32, device=DEV)
    slots, at = [], 0
    for i, (ql, L) in enumerate(zip(q_lens, seq_lens)):
        ids = perm[at:at + nbs[i]]
        at += nbs[i]
        tables[i, :nbs[i]] = ids.int()
        pos = torch.arange(L - ql, L, device=DEV)
        slots.append(ids[pos // bs] * bs + pos % bs)
        nctx = (L - ql) // bs
        if holes and nctx:
            tables[i, :nctx][torch.rand(nctx, device=DEV) < holes] = -1
    if store:
        for part in torch.arange(N * bs, device=DEV).split(1 << 16):
            kv = torch.randn(2, part.numel(), H, D, device=DEV, dtype=DT)
            triton_store.store_kvcache(kv[0], kv[1], cache, part)
    else:
        lo, hi = {16: (0, 0), 8: (-127, 128), 4: (0, 256)}[bits]
        for t in (cache.k, cache.v):
            t.copy_(torch.randn(t.shape, device=DEV).to(t.dtype) if bits == 16
                    else torch.randint_like(t, lo, hi))
        for t in (cache.k_scale, cache.v_scale, cache.k_zero, cache.v_zero):
            if t is not None:
                t.uniform_(0.005, 0.02)
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    npt = qsl[num_prefills]
    md = AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV), block_tables=tables,
        num_prefills=num_prefills, num_prefill_tokens=npt, num_decode_tokens=qsl[-1] - npt,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens))
    return cache, md


def record_check(name: str, err: float, tol: float, extra: str = "") -> None:
    ok = err == err and err < tol
    RESULTS["checks"].append({"check": name, "rel_err": err, "tol": tol, "ok": ok, "extra": extra})
    print(f"check {name:28s} rel_err={err:.2e} tol={tol:.0e} {'ok' if ok else 'FAIL'} {extra}", flush=True)


def check_store(bits: int) -> None:
    """Triton vs reference store on identically poisoned caches: codes within 1, scales bit-equal."""
    T, bs = (50, 16) if SMOKE else (8192, 16)
    a, b = (allocate_layer_cache(bits, T // bs + 8, H, bs, D, DT, DEV) for _ in range(2))
    names = ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero")
    pairs = [(getattr(a, n), getattr(b, n)) for n in names if getattr(a, n) is not None]
    for x, y in pairs:  # untouched slots must stay poisoned
        x.copy_(torch.full_like(x, float("nan")) if x.is_floating_point() else torch.randint_like(x, 0, 100))
        y.copy_(x)
    slots = torch.randperm(a.num_blocks * bs, device=DEV)[:T]
    slots[::9] = -1
    qkv = torch.randn(T, 3 * H, D, device=DEV, dtype=DT) * 3
    reference.store_kvcache(qkv[:, H:2 * H], qkv[:, 2 * H:], a, slots)
    triton_store.store_kvcache(qkv[:, H:2 * H], qkv[:, 2 * H:], b, slots)
    worst, mism = 0, 0
    for x, y in pairs:
        if x.is_floating_point():  # bit patterns, NaN poison included
            mism += int((x.view(torch.int16) != y.view(torch.int16)).sum())
            worst = max(worst, 99 if bool((x.view(torch.int16) != y.view(torch.int16)).any()) else 0)
        else:
            xs, ys = ((torch.cat([t & 15, t >> 4], -1) if bits == 4 else t).int() for t in (x, y))
            worst = max(worst, int((xs - ys).abs().max()))
            mism += int((xs != ys).sum())
    record_check(f"store bits={bits}", float(worst > 1), 0.5, f"mismatches={mism} max_diff={worst}")


def check_attention(bits: int, kind: str) -> None:
    if kind == "decode":
        B = 3 if SMOKE else 64
        q_lens, P = [1] * B, 0
        seq_lens = torch.randint(1, (70 if SMOKE else 4096) + 1, (B,)).tolist()
    elif kind == "prefill":  # fresh prompt, prefix hits, chunks starting off the block grid
        q_lens, seq_lens, P = [9, 5, 1], [9, 30, 41], 3
        if not SMOKE:
            q_lens, seq_lens, P = [777, 500, 1, 2000], [777, 1500, 2048, 2300], 4
    else:
        q_lens, seq_lens, P = [9, 5, 1, 1], [9, 30, 41, 66], 2
        if not SMOKE:
            q_lens, seq_lens = [300, 700] + [1] * 62, [300, 1900] + torch.randint(1, 4097, (62,)).tolist()
    cache, md = make_batch(bits, 16, q_lens, seq_lens, P, holes=0.2)
    q = torch.randn(sum(q_lens), H * G, D, device=DEV, dtype=DT)
    out = torch.full_like(q, float("nan"))
    TritonBackend().paged_attention(q, cache, md, SCALE, out=out)
    ref = reference.paged_attention(q.double(), cache, md, SCALE)
    nans = int(out.isnan().sum())
    err = float((out.double() - ref).norm() / ref.norm())
    record_check(f"{kind} bits={bits}", err if nans == 0 else float("nan"), 1e-2, f"nan={nans}")


def check_graph_replay() -> None:
    """Capture a decode step, then change lengths and block tables on the device: replays follow."""
    if DEV.type != "cuda":
        return
    B, ctx = 32, 2048
    cache, md = make_batch(16, 16, [1] * B, [ctx] * B, 0, store=False)
    q = torch.randn(B, H * G, D, device=DEV, dtype=DT)
    out, be, g = torch.empty_like(q), TritonBackend(), torch.cuda.CUDAGraph()
    be.paged_attention(q, cache, md, SCALE, out=out)
    with torch.cuda.graph(g):
        be.paged_attention(q, cache, md, SCALE, out=out)
    new_lens = torch.randint(1, ctx + 1, (B,))
    md.seq_lens.copy_(new_lens)
    md.seq_lens_cpu = new_lens.tolist()
    md.block_tables[:, 3] = -1
    out.fill_(float("nan"))
    g.replay()
    ref = reference.paged_attention(q.double(), cache, md, SCALE)
    err = float((out.double() - ref).norm() / ref.norm())
    record_check("decode cuda-graph replay", err if not out.isnan().any() else float("nan"), 1e-2)


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
    try:
        with torch.cuda.graph(graph):
            for i in range(reps):
                fn(i)
    except Exception as e:  # not capturable: time plain launches (launch gaps included)
        RESULTS["errors"].append(f"graph capture failed, timing eagerly: {type(e).__name__}: {e}"[:300])
        torch.cuda.synchronize()
        graph = None

    def run() -> None:
        if graph is not None:
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


def decode_fn(cache: LayerKVCache, md: AttentionMetadata, cfg: TritonConfig) -> Callable[[int], object]:
    B = md.num_seqs
    qs = [torch.randn(B, H * G, D, device=DEV, dtype=DT) for _ in range(4)]
    out = torch.empty_like(qs[0])
    splits = choose_splits(cfg, B, H, md.max_seq_len, sm_count(DEV))
    return lambda i: triton_decode.paged_decode(
        qs[i % 4], cache, md.block_tables, md.seq_lens, out, SCALE, num_splits=splits,
        block_n=cfg.decode_block_n, num_warps=cfg.decode_warps, num_stages=cfg.decode_stages)


def bench_copy() -> None:
    src = torch.randn((1 << 20) if SMOKE else (1 << 30), device=DEV)
    dst = torch.empty_like(src)
    bench_row("device copy (read + write)", timed(lambda i: dst.copy_(src)), 2 * src.numel() * 4)


def bench_decode() -> None:
    """Dense SDPA and default-config paged decode per format and block size. vs_sdpa = SDPA time / ours."""
    for B, ctx in decode_shapes():
        kd, vd = (torch.randn(B, H, ctx, D, device=DEV, dtype=DT) for _ in range(2))
        qs = [torch.randn(B, H * G, 1, D, device=DEV, dtype=DT) for _ in range(4)]
        ms = timed(lambda i, kd=kd, vd=vd, qs=qs: F.scaled_dot_product_attention(qs[i % 4], kd, vd,
                                                                                 enable_gqa=True))
        SDPA_MS[(B, ctx)] = bench_row(f"sdpa dense decode B={B} ctx={ctx}", ms, kv_bytes(16, B * ctx))["ms"]
        del kd, vd
        for bits in (16, 8, 4):
            cache, md = make_batch(bits, 16, [1] * B, [ctx] * B, 0, store=False)
            splits = choose_splits(TritonConfig(), B, H, ctx, sm_count(DEV))
            ms = timed(decode_fn(cache, md, TritonConfig()))
            row = bench_row(f"triton decode bits={bits} B={B} ctx={ctx}", ms, kv_bytes(bits, B * ctx),
                            splits=splits)
            row["vs_sdpa"] = SDPA_MS[(B, ctx)] / row["ms"]
    B, ctx = decode_shapes()[0]
    for bs in (8, 32) if SMOKE else (8, 32, 64, 256):  # any power-of-2 block size, same tiles
        cache, md = make_batch(16, bs, [1] * B, [ctx] * B, 0, store=False)
        ms = timed(decode_fn(cache, md, TritonConfig()))
        row = bench_row(f"triton decode bits=16 B={B} ctx={ctx} bs={bs}", ms, kv_bytes(16, B * ctx))
        row["vs_sdpa"] = SDPA_MS[(B, ctx)] / row["ms"]


def bench_prefill() -> None:
    """P prompts of L tokens: fresh (vs dense causal SDPA) and half-cached; a few tile configs."""
    P, L = (2, 40) if SMOKE else (8, 2048)
    kd, qd = torch.randn(P, H, L, D, device=DEV, dtype=DT), torch.randn(P, H * G, L, D, device=DEV, dtype=DT)
    ms = timed(lambda i: F.scaled_dot_product_attention(qd, kd, kd, is_causal=True, enable_gqa=True))
    bench_row(f"sdpa causal prefill {P}x{L}", ms, flops=4 * P * H * G * D * L * (L + 1) / 2)
    configs = [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 3), (64, 32, 4, 3), (128, 32, 8, 3),
               (128, 128, 8, 2)][:1 if SMOKE else None]
    for bits in (16, 8, 4):
        for cached in (0, L // 2):
            cache, md = make_batch(bits, 16, [L - cached] * P, [L] * P, P, store=False)
            q = torch.randn(md.num_prefill_tokens, H * G, D, device=DEV, dtype=DT)
            out = torch.empty_like(q)
            fl = 4 * P * H * G * D * sum(cached + j + 1 for j in range(L - cached))
            for bm, bn, w, st in configs if bits == 16 else configs[:1]:
                be = TritonBackend(TritonConfig(prefill_block_m=bm, prefill_block_n=bn, prefill_warps=w,
                                                prefill_stages=st))
                try:
                    ms = timed(lambda i, be=be, q=q, c=cache, md=md, o=out:
                               be.paged_attention(q, c, md, SCALE, out=o))
                except Exception as e:
                    RESULTS["errors"].append(f"prefill {bm},{bn},{w},{st}: {type(e).__name__}: {e}"[:300])
                    continue
                bench_row(f"triton prefill bits={bits} {P}x{L} cached={cached} cfg={bm},{bn},{w},{st}", ms,
                          flops=fl)


def sweep(budget_s: float) -> None:
    """bf16 decode: tile size x warps x pipeline depth x split count, until the time budget runs out."""
    grid = [(bn, w, st) for bn in (64, 128, 32) for w in (4, 8) for st in (2, 3, 1)]
    for B, ctx in decode_shapes():
        cache, md = make_batch(16, 16, [1] * B, [ctx] * B, 0, store=False)
        for bn, w, st in grid[:1] if SMOKE else grid:
            for splits in (1, 2) if SMOKE else (1, 2, 4, 8):
                if time.time() - T0 > budget_s:
                    RESULTS["errors"].append(f"sweep cut at B={B} {bn},{w},{st},{splits}: time budget")
                    return
                try:
                    ms = timed(decode_fn(cache, md, TritonConfig(decode_block_n=bn, decode_warps=w,
                                                                 decode_stages=st, decode_splits=splits)))
                except Exception as e:  # a config that fails to compile (shared memory) is skipped
                    RESULTS["errors"].append(f"sweep {bn},{w},{st},{splits}: {type(e).__name__}: {e}"[:300])
                    continue
                gbs = kv_bytes(16, B * ctx) / ms / 1e6
                RESULTS["sweep"].append({"B": B, "ctx": ctx, "block_n": bn, "warps": w, "stages": st,
                                         "splits": splits, "us": ms * 1e3, "GB/s": gbs,
                                         "vs_sdpa": SDPA_MS[(B, ctx)] / ms})
                print(f"sweep B={B} ctx={ctx} bn={bn} w={w} st={st} splits={splits}: {ms * 1e3:.1f} us "
                      f"{gbs:.0f} GB/s {SDPA_MS[(B, ctx)] / ms:.2f}x sdpa", flush=True)


def summary() -> None:
    print("\n== summary ==", RESULTS.get("device"))
    for c in RESULTS["checks"]:
        print(f"{c['check']:28s} {c['rel_err']:.2e} {'ok' if c['ok'] else 'FAIL'} {c['extra']}")
    for r in RESULTS["bench"]:
        rate = f"{r['TFLOP/s']:6.1f} TFLOP/s" if r["TFLOP/s"] else f"{r['GB/s']:6.0f} GB/s"
        vs = f" {r['vs_sdpa']:.2f}x sdpa" if "vs_sdpa" in r else ""
        print(f"{r['name']:60s} {r['ms'] * 1e3:9.1f} us {rate}{vs}")
    for B, ctx in SDPA_MS:
        rows = [r for r in RESULTS["sweep"] if (r["B"], r["ctx"]) == (B, ctx)]
        for r in sorted(rows, key=lambda r: -r["GB/s"])[:3]:
            print(f"sweep top B={B} ctx={ctx}: bn={r['block_n']} w={r['warps']} st={r['stages']} "
                  f"splits={r['splits']} {r['us']:.1f} us {r['GB/s']:.0f} GB/s {r['vs_sdpa']:.2f}x sdpa")
    for e in RESULTS["errors"]:
        print("error:", e[:300])
    print(f"total {time.time() - T0:.0f}s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds after which the sweep stops")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    import triton
    RESULTS["device"] = {"triton": triton.__version__, "torch": torch.__version__,
                         "date": time.strftime("%F %T")}
    if DEV.type == "cuda":
        p = torch.cuda.get_device_properties(DEV)
        RESULTS["device"].update(name=p.name, sms=p.multi_processor_count)
    steps = [lambda: [check_store(b) for b in (16, 8, 4)],
             lambda: [check_attention(b, k) for k in ("decode", "prefill", "mixed") for b in (16, 8, 4)],
             check_graph_replay, bench_copy, bench_decode, bench_prefill, lambda: sweep(args.budget)]
    for step in steps:
        try:
            step()
        except Exception as e:
            RESULTS["errors"].append(f"{type(e).__name__}: {str(e)[:400]}")
            print("ERROR", RESULTS["errors"][-1], flush=True)
        with open(os.path.join(args.out, "gpu_kernels.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    summary()


if __name__ == "__main__":
    main()
