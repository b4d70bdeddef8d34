"""Paged prefill of a continuing chunk (a prompt cut by the previous step), quick A/B timings.

  python -m nanokv_tools.bench.prefill_probe --bits 4 --variants ";prefill_tile_kinds=0"

What the long-context run sends to the paged prefill kernel: one sequence per step continues a
chunk, C earlier tokens in the cache (int4: quantized blocks) and L new ones (stored this step;
int4: staged). Qwen3-0.6B layer shapes (nanokv_tools.bench.gpu_kernels), K/V written by the store.
Each variant is a TritonConfig override list (kernel_options syntax); "" is the default config.
"""

from __future__ import annotations

import argparse
import functools
from typing import cast

import torch

from nanokv.kernels.triton_backend import TritonBackend
from nanokv.kernels.triton_config import apply_overrides, default_config
from nanokv.kernels.triton_selfcheck import make_batch
from nanokv.kv.cache import Int4KV, LayerKV
from nanokv.kv.metadata import AttentionMetadata
from nanokv_tools.bench.gpu_kernels import SCALE, SH, timed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes (a rehearsal)")
    ap.add_argument("--bits", type=int, default=4, choices=(16, 8, 4))
    ap.add_argument("--block-size", type=int, default=0, help="0: 32 for int4, else 16 (the engine's)")
    ap.add_argument("--chunks", default="2048:2048,3072:1024,1024:3072",
                    help="C:L pairs, earlier tokens : new tokens, one launch each")
    ap.add_argument("--variants", default="", help="';'-separated override lists; '' = defaults")
    ap.add_argument("--fill", action="store_true", help="int4: also time the fill kernel of a prefill step")
    ap.add_argument("--rope", action="store_true", help="also time the q/k norm + RoPE kernel")
    args = ap.parse_args(argv)
    bs = args.block_size or (32 if args.bits == 4 else 16)
    total: dict[str, float] = {}
    for chunk in args.chunks.split(","):
        C, L = (int(x) for x in chunk.split(":"))
        if args.smoke:
            C, L = C // 64, L // 64
        torch.manual_seed(0)
        cache, md = make_batch(SH, args.bits, bs, [L], [C + L], 1, store=True)
        q = torch.randn(L, SH.H * SH.G, SH.D, device=SH.dev, dtype=SH.dtype)
        first = None
        for spec in args.variants.split(";"):
            be = TritonBackend(apply_overrides(default_config(), spec))
            out = torch.empty_like(q)

            def step(i: int, be: TritonBackend = be, out: torch.Tensor = out, q: torch.Tensor = q,
                     cache: LayerKV = cache, md: AttentionMetadata = md) -> object:
                return be.paged_attention(q, cache, md, SCALE, out=out)
            res = cast(torch.Tensor, step(0)).float()
            if first is None:
                first = res.clone()
            err = ((res - first).norm() / first.norm()).item()
            ms = timed(step)
            total[spec] = total.get(spec, 0.0) + ms
            print(f"prefill_probe bits={args.bits} bs={bs} C={C} L={L} [{spec}]: {ms * 1e3:.1f} us, relative "
                  f"difference to [{args.variants.split(';')[0]}] {err:.2e}, finite {bool(res.isfinite().all())}",
                  flush=True)
    for spec, ms in total.items():
        print(f"prefill_probe bits={args.bits} all chunks [{spec}]: {ms * 1e3:.1f} us", flush=True)
    if args.fill and args.bits == 4:
        time_fill(bs, 4 if args.smoke else 8, 64 if args.smoke else 2048)
    if args.rope:
        time_rope(args.bits)
    return 0


def time_rope(bits: int) -> None:
    """The q/k norm + RoPE kernel (with the format's rotation below 16 bits) over a 16k-token prefill
    step and a 128-token decode step, at several tokens per program."""
    from nanokv.kernels import triton_rope
    from nanokv.kv.rotation import rotation_matrix
    Hq, Hk, D = SH.H * SH.G, SH.H, SH.D
    odt = torch.float16 if bits < 16 else SH.dtype  # the attention's dtype (nanokv.compute_service.kv_hooks.qk_dtype)
    rot = rotation_matrix(D, odt).to(SH.dev) if bits < 16 else None
    for T in (64, 256) if SH.dev.type == "cpu" else (16384, 128):
        qk = torch.randn(T, Hq + Hk, D, device=SH.dev, dtype=SH.dtype)
        w = torch.rand(D, device=SH.dev, dtype=SH.dtype) + 0.5
        cs = torch.randn(T, 1, D, device=SH.dev, dtype=SH.dtype)
        cos, sin = cs[..., :D // 2], cs[..., D // 2:]
        for tok in (1, 2, 4, 8):
            ms = timed(functools.partial(lambda i, a: triton_rope.qk_norm_rope(*a), a=(
                qk, cos, sin, odt, (w, w, 1e-6, Hq), rot, tok)))
            print(f"prefill_probe rope bits={bits} T={T}, {tok} tokens per program: {ms * 1e3:.1f} us", flush=True)


def time_fill(bs: int, P: int, L: int) -> None:
    """The int4 quantize-on-fill launch of a prefill step (P fresh prompts of L tokens): one program
    per filled block, KV head and K or V, as the runner launches it (md.extras["fill_slots"])."""
    from nanokv.kernels.triton_blockquant import quantize_filled_graphsafe
    cache, md = make_batch(SH, 4, bs, [L] * P, [L] * P, P, store=True)
    if not isinstance(cache, Int4KV):
        raise TypeError(f"an int4 batch, got {type(cache).__name__}")
    slots = md.slot_mapping[md.slot_mapping % bs == bs - 1].contiguous()
    for recip in (False, True):  # (TritonConfig.fill_recip)
        for w in (1, 2, 4, 8):
            ms = timed(functools.partial(lambda i, w, r: quantize_filled_graphsafe(cache, slots, w, r), w=w, r=recip))
            print(f"prefill_probe fill kernel, {w} warps, {slots.numel()} blocks x {cache.num_kv_heads} heads"
                  f"{', reciprocal' * recip}: {ms * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
