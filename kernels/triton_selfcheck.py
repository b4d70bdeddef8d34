"""GPU self-checks of the Triton KV kernels at real shapes, against a float64 reference.

Used by nanokv_tools.bench.gpu_kernels (one device run checks, then times). Every check draws fresh random
inputs, NaN-poisons the outputs, and compares against the torch reference run in float64 on the
same cache contents (relative error ||out - ref|| / ||ref||); the store is compared code by code.
`Shapes(small=True)` runs the same logic on the CPU under TRITON_INTERPRET=1 at tiny shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nanokv.kernels import reference, triton_store
from nanokv.kernels.triton_backend import TritonBackend
from nanokv.kernels.triton_config import TritonConfig
from nanokv.kv.blockquant import quantize_filled
from nanokv.kv.cache import Int4KV, LayerKV, allocate_layer_cache
from nanokv.kv.metadata import AttentionMetadata


@dataclass
class Shapes:
    dev: torch.device
    dtype: torch.dtype
    H: int  # kv heads
    G: int  # query heads per kv head
    D: int  # head dim
    small: bool  # tiny shapes (CPU interpreter)
    checks: list[dict] = field(default_factory=list)

    @property
    def scale(self) -> float:
        return self.D ** -0.5


def make_batch(sh: Shapes, bits: int, bs: int, q_lens: list[int], seq_lens: list[int], num_prefills: int,
               holes: float = 0.0, store: bool = True) -> tuple[LayerKV, AttentionMetadata]:
    """Scattered block tables; blocks wholly before a sequence's first query token are dropped with
    probability `holes`. store: K/V written by the Triton store, else random codes (timing only)."""
    nbs = [-(-L // bs) for L in seq_lens]
    N = sum(nbs) + 1
    cache = allocate_layer_cache(bits, N, sh.H, bs, sh.D, sh.dtype, sh.dev)
    perm = torch.randperm(N, device=sh.dev)
    tables = torch.full((len(seq_lens), max(nbs)), -1, dtype=torch.int32, device=sh.dev)
    slots, at = [], 0
    for i, (ql, L) in enumerate(zip(q_lens, seq_lens)):
        ids = perm[at:at + nbs[i]]
        at += nbs[i]
        tables[i, :nbs[i]] = ids.int()
        pos = torch.arange(L - ql, L, device=sh.dev)
        slots.append(ids[pos // bs] * bs + pos % bs)
        nctx = (L - ql) // bs
        if holes and nctx:
            tables[i, :nctx][torch.rand(nctx, device=sh.dev) < holes] = -1
    if store:
        kv = torch.randn(2, N * bs, sh.H, sh.D, device=sh.dev, dtype=sh.dtype)
        _store_all(cache, kv, torch.arange(N * bs, device=sh.dev))
        if isinstance(cache, Int4KV):  # int4: blocks holding this step's tokens are open (staged)
            open_blocks = torch.cat(slots).div(bs, rounding_mode="floor").unique()
            rows = (open_blocks[:, None] * bs + torch.arange(bs, device=sh.dev)).reshape(-1)
            cache.stage.plan(rows.cpu().numpy())
            triton_store.store_kvcache(kv[0][rows], kv[1][rows], cache, rows)
    else:
        lo, hi = {16: (0, 0), 8: (-127, 128), 4: (0, 256)}[bits]
        for t in (cache.k, cache.v):
            t.copy_(torch.randn(t.shape, device=sh.dev).to(t.dtype) if bits == 16
                    else torch.randint_like(t, lo, hi))
        for name in cache.block_fields[2:]:  # scales and zero points
            getattr(cache, name).uniform_(0.005, 0.02)
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    npt = qsl[num_prefills]
    md = AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=sh.dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=sh.dev), block_tables=tables,
        num_prefills=num_prefills, num_prefill_tokens=npt, num_decode_tokens=qsl[-1] - npt,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens))
    return cache, md


def _store_all(cache: LayerKV, kv: torch.Tensor, slots: torch.Tensor) -> None:
    """Triton store of kv [2, T, H, D] at slots; int4 as the runner does it: staged, then every filled
    block quantized once (nanokv.kv.blockquant) and its staging released."""
    for part in slots.split(1 << 16):
        if isinstance(cache, Int4KV):
            cache.stage.plan(part.cpu().numpy())
        triton_store.store_kvcache(kv[0][part], kv[1][part], cache, part)
        if isinstance(cache, Int4KV):
            quantize_filled(cache)
            cache.stage.finish()


def record_check(sh: Shapes, name: str, err: float, tol: float, extra: str = "") -> None:
    ok = err == err and err < tol
    sh.checks.append({"check": name, "rel_err": err, "tol": tol, "ok": ok, "extra": extra})
    print(f"check {name:28s} rel_err={err:.2e} tol={tol:.0e} {'ok' if ok else 'FAIL'} {extra}", flush=True)


def check_store(sh: Shapes, bits: int) -> None:
    """Triton vs reference store on identically poisoned caches: codes within 1, scales bit-equal
    (int4: the full-precision staging the store writes, bit-equal)."""
    T, bs = (50, 16) if sh.small else (8192, 16)
    a, b = (allocate_layer_cache(bits, T // bs + 8, sh.H, bs, sh.D, sh.dtype, sh.dev) for _ in range(2))
    pairs = [(x, b.tensors()[n]) for n, x in a.tensors().items()]
    for x, y in pairs:  # untouched slots must stay poisoned
        x.copy_(torch.full_like(x, float("nan")) if x.is_floating_point() else torch.randint_like(x, 0, 100))
        y.copy_(x)
    slots = torch.randperm(a.num_blocks * bs, device=sh.dev)[:T]
    slots[::9] = -1
    for c in (a, b):  # int4 stores into staging: slots planned first, as the runner does
        if isinstance(c, Int4KV):
            c.stage.plan(slots.cpu().numpy())
    qkv = torch.randn(T, 3 * sh.H, sh.D, device=sh.dev, dtype=sh.dtype) * 3
    reference.store_kvcache(qkv[:, sh.H:2 * sh.H], qkv[:, 2 * sh.H:], a, slots)
    triton_store.store_kvcache(qkv[:, sh.H:2 * sh.H], qkv[:, 2 * sh.H:], b, slots)
    worst, mism = 0, 0
    for x, y in pairs:
        if x.is_floating_point():  # bit patterns, NaN poison included
            mism += int((x.view(torch.int16) != y.view(torch.int16)).sum())
            worst = max(worst, 99 if bool((x.view(torch.int16) != y.view(torch.int16)).any()) else 0)
        else:
            xs, ys = ((torch.cat([t & 15, t >> 4], -1) if bits == 4 else t).int() for t in (x, y))
            worst = max(worst, int((xs - ys).abs().max()))
            mism += int((xs != ys).sum())
    record_check(sh, f"store bits={bits}", float(worst > 1), 0.5, f"mismatches={mism} max_diff={worst}")


def check_attention(sh: Shapes, bits: int, kind: str, cfg: TritonConfig | None = None,
                    label: str = "") -> None:
    if kind == "decode":
        B = 3 if sh.small else 64
        q_lens, P = [1] * B, 0
        seq_lens = torch.randint(1, (70 if sh.small else 4096) + 1, (B,)).tolist()
    elif kind == "prefill":  # fresh prompt, prefix hits, chunks starting off the block grid
        q_lens, seq_lens, P = [9, 5, 1], [9, 30, 41], 3
        if not sh.small:
            q_lens, seq_lens, P = [777, 500, 1, 2000], [777, 1500, 2048, 2300], 4
    else:
        q_lens, seq_lens, P = [9, 5, 1, 1], [9, 30, 41, 66], 2
        if not sh.small:
            q_lens, seq_lens = [300, 700] + [1] * 62, [300, 1900] + torch.randint(1, 4097, (62,)).tolist()
    cache, md = make_batch(sh, bits, 16, q_lens, seq_lens, P, holes=0.2)
    q = torch.randn(sum(q_lens), sh.H * sh.G, sh.D, device=sh.dev, dtype=sh.dtype)
    out = torch.full_like(q, float("nan"))
    TritonBackend(cfg).paged_attention(q, cache, md, sh.scale, out=out)
    ref = reference.paged_attention(q.double(), cache, md, sh.scale)
    nans = int(out.isnan().sum())
    err = float((out.double() - ref).norm() / ref.norm())
    record_check(sh, f"{kind} bits={bits}{label}", err if nans == 0 else float("nan"), 1e-2, f"nan={nans}")


def check_all(sh: Shapes) -> None:
    for b in (16, 8, 4):
        check_store(sh, b)
    for kind in ("decode", "prefill", "mixed"):
        for b in (16, 8, 4):
            check_attention(sh, b, kind)
    for b in (16, 8):
        check_graph_replay(sh, b)
    check_int4_fill_graph(sh)


def _untransposed(**kw: Any) -> TritonConfig:
    """int8 through the untransposed kernel (its variants), not triton_decode_swap."""
    return TritonConfig(quant_swap_block_n=0, **kw)


def check_variants(sh: Shapes) -> None:
    """The non-default code paths and tile shapes the sweep times must compute the same function."""
    for n, splits in ((32, 1), (64, 3), (16, 2)):
        check_attention(sh, 8, "decode", TritonConfig(quant_swap_block_n=n, decode_splits=splits), f" swap{n}s{splits}")
    for bits in (8, 4):
        check_attention(sh, bits, "decode", _untransposed(asm=False), " asm=off")
        tiles2 = _untransposed(quant_block_n=128, quant_warps=4, quant_stages=3, prefill_block_m=128,
                              prefill_block_n=32)
        check_attention(sh, bits, "mixed", tiles2, " tiles2")
        check_attention(sh, bits, "decode", _untransposed(words=False), " words=off")
        check_attention(sh, bits, "decode", _untransposed(quant_fold_k=False, quant_fold_v=False), " fold=off")
        check_attention(sh, bits, "decode", _untransposed(quant_fold_v=False), " fold_v=off")
        check_attention(sh, bits, "decode", _untransposed(quant_block_n=32, quant_warps=1, decode_splits=4), " w1s4")
        check_attention(sh, bits, "decode", _untransposed(quant_block_n=128, quant_warps=2, quant_stages=3,
                                                         decode_splits=2), " bn128w2s2")
        check_attention(sh, bits, "decode", _untransposed(quant_lazy_tau=8), " lazy8")
        check_attention(sh, bits, "decode", _untransposed(quant_min_rows=1), " rows1")
    check_attention(sh, 16, "decode", TritonConfig(decode_block_n=128, decode_warps=4, decode_splits=3),
                    " tiles2")


def check_graph_replay(sh: Shapes, bits: int) -> None:
    """Capture a decode step, then change lengths and block tables on the device: replays follow."""
    if sh.dev.type != "cuda":
        return
    B, ctx = 32, 2048
    cache, md = make_batch(sh, bits, 16, [1] * B, [ctx] * B, 0, store=False)
    q = torch.randn(B, sh.H * sh.G, sh.D, device=sh.dev, dtype=sh.dtype)
    out, be, g = torch.empty_like(q), TritonBackend(), torch.cuda.CUDAGraph()
    be.paged_attention(q, cache, md, sh.scale, out=out)
    with torch.cuda.graph(g):
        be.paged_attention(q, cache, md, sh.scale, out=out)
    new_lens = torch.randint(1, ctx + 1, (B,))
    md.seq_lens.copy_(new_lens)
    md.seq_lens_cpu = new_lens.tolist()
    md.block_tables[:, 3] = -1
    out.fill_(float("nan"))
    g.replay()
    ref = reference.paged_attention(q.double(), cache, md, sh.scale)
    err = float((out.double() - ref).norm() / ref.norm())
    record_check(sh, f"decode graph replay bits={bits}", err if not out.isnan().any() else float("nan"), 1e-2)


def check_int4_fill_graph(sh: Shapes) -> None:
    """int4 decode step in a CUDA graph: the device-side quantize-on-fill (triton_blockquant) leaves
    the cache bit-identical to the eager torch path, and attention before it is unchanged."""
    if sh.dev.type != "cuda":
        return
    from nanokv.kernels.triton_blockquant import quantize_filled_graphsafe
    B = 64
    lens = (torch.randint(1, 257, (B,)) * 16 - torch.randint(0, 2, (B,)) * 5).tolist()  # half fill a block
    cache, md = make_batch(sh, 4, 16, [1] * B, lens, 0)
    if not isinstance(cache, Int4KV):
        raise TypeError(f"an int4 batch, got {type(cache).__name__}")
    cache.stage.plan(md.slot_mapping.cpu().numpy())  # this step's fill list (the runner's plan)
    names = cache.block_fields
    before = [getattr(cache, n).clone() for n in names]
    quantize_filled(cache)
    eager = [getattr(cache, n).clone() for n in names]
    for n, t in zip(names, before):
        getattr(cache, n).copy_(t)
    q = torch.randn(B, sh.H * sh.G, sh.D, device=sh.dev, dtype=sh.dtype)
    out, be, g = torch.empty_like(q), TritonBackend(), torch.cuda.CUDAGraph()
    be.paged_attention(q, cache, md, sh.scale, out=out)  # warm-up (compiles)
    quantize_filled_graphsafe(cache, torch.full_like(md.slot_mapping, -1))  # compiles, writes nothing
    with torch.cuda.graph(g):
        be.paged_attention(q, cache, md, sh.scale, out=out)
        quantize_filled_graphsafe(cache, md.slot_mapping)
    ref = reference.paged_attention(q.double(), cache, md, sh.scale)
    out.fill_(float("nan"))
    g.replay()
    err = float((out.double() - ref).norm() / ref.norm())
    diff = sum(int((getattr(cache, n) != e).sum()) for n, e in zip(names, eager))
    record_check(sh, "int4 fill graph", err if diff == 0 and not out.isnan().any() else float("nan"), 1e-2,
                 f"filled={int(cache.stage.fill_blocks.numel())} cache_mismatches={diff}")
