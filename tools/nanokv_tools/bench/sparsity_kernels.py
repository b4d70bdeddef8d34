"""The kernel section of nanokv_tools.bench.gpu_sparsity: nanokv.kernels.triton_hybrid at real shapes.

Decode (split-K and not) and prefill chunks on tables that mix int8 pool blocks, INT4 demotion-store
slots and holes, at Llama-3-8B (32/8 heads) and Qwen3-0.6B (16/8) shapes, D = 128, fp16 and bf16
queries: each one's max error against the torch reference (nanokv.kernels.reference) and its time,
next to the plain int8 decode kernel on the same lengths with no holes.
"""

from __future__ import annotations

import random
from typing import Any

import torch

SHAPES = {"llama3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128)}  # (query heads, KV heads, head dim)


def _timed(fn) -> float:
    """Milliseconds per call (20 calls after one warm-up)."""
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 20


def _metadata(lens: list[int], qlens: list[int], table: torch.Tensor, prefill: bool, device: str):
    from nanokv.kv.metadata import AttentionMetadata

    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    B = len(lens)
    return AttentionMetadata(
        slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_tables=table.to(device),
        num_prefills=B if prefill else 0, num_prefill_tokens=qsl[-1] if prefill else 0,
        num_decode_tokens=0 if prefill else B, max_query_len=max(qlens), max_seq_len=max(lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens)


def _case(cache, g: torch.Generator, Hq: int, B: int, lens_range: tuple[int, int], prefill: bool,
          dtype: torch.dtype, device: str) -> list[dict[str, Any]]:
    """One batch on a mixed table (about 20% holes, 30% slots, the rest pool; the block each sequence
    writes is a pool block): every hybrid kernel's max error against the reference, and its time. Decode
    also runs on the hybrid policy's own mix at s = 0.5 ("_mix50": of the ranked blocks (1-s)^2 = 25% stay
    INT8, s(1-s) = 25% INT4, s = 50% dropped; nanokv.cache_service.sparsity.policies), and the plain int8
    kernel on the same lengths with no holes, every block in the pool (same tiles: paged_decode's defaults).
    hybrid_decode_s8_n{block_n}w{warps}: other tiles (the defaults are 64 tokens, 4 warps).
    hybrid_block_s{splits}[_r96][_bias][_mix50]: hybrid_decode(per_block=True) (one branch per 16-token
    block; _r96: 96 registers a thread at most; _bias: block_bias) on the same tables; int8_swap_dense_s8:
    the transposed int8 kernel (triton_decode_swap) at TritonConfig's int8 decode settings, the int8 TPOT's
    decode kernel."""
    from nanokv.kernels import reference, triton_decode, triton_hybrid

    lens = [random.Random(i).randint(*lens_range) for i in range(B)]
    qlens = [min(512, L) for L in lens] if prefill else [1] * B
    m, pool = _mixed(cache, g, lens, qlens, (0.2, 0.3), prefill, device)
    q = torch.randn(sum(qlens), Hq, cache.head_dim, generator=g).to(device, dtype)
    scale = cache.head_dim ** -0.5
    want = reference.paged_attention(q.float(), cache, m, scale)
    out = torch.empty_like(q)
    runs: dict[str, Any] = {}  # name -> (call, reference output or None)
    if prefill:
        runs["hybrid_prefill"] = (lambda: triton_hybrid.hybrid_prefill(
            q, cache, m.block_tables, m.seq_lens, m.query_start_loc, m.max_query_len, out, scale), want)
    else:
        for s in (1, 8):
            runs[f"hybrid_decode_s{s}"] = (lambda s=s: triton_hybrid.hybrid_decode(
                q, cache, m.block_tables, m.seq_lens, out, scale, num_splits=s), want)
        for bn, warps in ((64, 8), (32, 4)):  # (64, 8): what TritonBackend passes; (32, 4): fewer registers
            runs[f"hybrid_decode_s8_n{bn}w{warps}"] = (lambda bn=bn, warps=warps: triton_hybrid.hybrid_decode(
                q, cache, m.block_tables, m.seq_lens, out, scale, num_splits=8, block_n=bn, num_warps=warps), want)
        m50, _ = _mixed(cache, g, lens, qlens, (0.5, 0.25), False, device)
        want50 = reference.paged_attention(q.float(), cache, m50, scale)
        runs["hybrid_decode_s8_mix50"] = (lambda: triton_hybrid.hybrid_decode(
            q, cache, m50.block_tables, m50.seq_lens, out, scale, num_splits=8), want50)
        for s, reg, bias in ((8, 0, False), (16, 0, False), (8, 96, False), (8, 0, True)):  # the block kernel
            for mix, md, ref in (("", m, want), ("_mix50", m50, want50)):
                runs[f"hybrid_block_s{s}{'_r96' if reg else ''}{'_bias' if bias else ''}{mix}"] = (
                    lambda md=md, s=s, reg=reg, bias=bias: triton_hybrid.hybrid_decode(
                        q, cache, md.block_tables, md.seq_lens, out, scale, num_splits=s, per_block=True,
                        block_maxnreg=reg, block_bias=bias), ref)
        dense = _metadata(lens, qlens, pool.int(), False, device)
        plain = allocate_plain(cache)
        runs["int8_decode_dense_s8"] = (lambda: triton_decode.paged_decode(
            q, plain, dense.block_tables, dense.seq_lens, torch.empty_like(q), scale, num_splits=8), None)
        runs["int8_swap_dense_s8"] = (lambda: triton_decode.paged_decode(  # TritonConfig's int8 decode tiles
            q, plain, dense.block_tables, dense.seq_lens, torch.empty_like(q), scale, num_splits=8, swap_block_n=16,
            swap_maxnreg=96, swap_stages=3), None)
    rows = []
    for kname, (fn, ref) in runs.items():
        fn()
        err = None if ref is None else float((out.float() - ref).abs().max())
        rows.append({"kernel": kname, "dtype": str(dtype).removeprefix("torch."), "batch": B, "max_len": max(lens),
                     "max_abs_err": err, "ok": err is None or err < 3e-2,
                     "ms": _timed(fn) if device == "cuda" else None})
    return rows


def _mixed(cache, g: torch.Generator, lens: list[int], qlens: list[int], mix: tuple[float, float], prefill: bool,
           device: str):
    """(metadata over a random table of these lengths with about mix = (hole, slot) fractions of holes and
    store slots, the rest pool blocks; the pool blocks drawn [B, width]). The block each sequence writes
    is a pool block."""
    from nanokv.kv.demote import code

    bs, N, M = cache.block_size, cache.num_blocks, cache.demoted.k.shape[0]
    B, width = len(lens), -(-max(lens) // bs)
    kinds = torch.rand((B, width), generator=g)
    pool = torch.randint(M, N, (B, width), generator=g)
    slots = torch.randint(0, M, (B, width), generator=g)
    mixed = torch.where(kinds < mix[0], -1, torch.where(kinds < mix[0] + mix[1], code(0) - slots, pool)).int()
    for i, L in enumerate(lens):
        mixed[i, (L - 1) // bs] = pool[i, (L - 1) // bs]
    return _metadata(lens, qlens, mixed, prefill, device), pool


def allocate_plain(cache):
    """The int8 layer under a hybrid one (the same tensors, no store): what the plain kernels read."""
    from dataclasses import fields

    from nanokv.kv.cache import Int8KV

    return Int8KV(**{f.name: getattr(cache, f.name) for f in fields(Int8KV)})


def kernel_checks(device: str, block_size: int = 16) -> list[dict[str, Any]]:
    from nanokv.kernels import reference
    from nanokv.kv.cache import Int8KV, allocate_layer_cache
    from nanokv.kv.demote import DemotedBlocks, HybridInt8KV

    rows = []
    for name, (Hq, H, D) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        N, M = 4096, 1024
        c = allocate_layer_cache(8, N, H, block_size, D, torch.float16, device)
        assert isinstance(c, Int8KV)
        kv = torch.randn(2, N * block_size, H, D, generator=g).to(device)
        reference.store_kvcache(kv[0], kv[1], c, torch.arange(N * block_size, device=device))
        st = DemotedBlocks.zeros(M, c)
        st.write(c, torch.arange(M, device=device), torch.arange(M, device=device))
        cache = HybridInt8KV.of(c, st)
        for B, lens_range, prefill in ((32, (512, 8192), False), (4, (1024, 4096), True)):
            for dtype in (torch.float16, torch.bfloat16):
                for row in _case(cache, g, Hq, B, lens_range, prefill, dtype, device):
                    row["shape"] = name
                    rows.append(row)
                    err = row["max_abs_err"]
                    print(f"[kernel] {name:10s} {row['kernel']:26s} {row['dtype']:8s} B={B} max_len={row['max_len']} "
                          f"err={'-' if err is None else f'{err:.2e}'} ms={row['ms']} {'ok' if row['ok'] else 'FAIL'}")
    return rows
