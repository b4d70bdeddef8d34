"""One paged-decode shape, launched a few times: the target of a profiler run, or quick A/B timings.

  ncu -k regex:decode --launch-skip 2 --launch-count 1 python -m nanokv_tools.bench.decode_probe --bits 8
  python -m nanokv_tools.bench.decode_probe --bits 8 --time --variants "quant_stages=1;quant_block_n=64"

Qwen3-0.6B layer shapes (16 q heads, 8 KV heads, dim 128), bf16 queries, random codes in scattered
16-token blocks (as in nanokv_tools.bench.gpu_kernels). Each variant is a TritonConfig override list
(kernel_options syntax) applied on top of the defaults; "" is the default config.
"""

from __future__ import annotations

import argparse
import functools
import random
from typing import cast

import torch

from nanokv.kernels import triton_decode, triton_decode_int4, triton_decode_swap, triton_decode_swap4
from nanokv.kernels.triton_config import apply_overrides, default_config
from nanokv.kernels.triton_selfcheck import make_batch
from nanokv.kv.cache import Int4KV
from nanokv_tools.bench.gpu_kernels import SH, decode_fn, kv_bytes, timed


def compiled_resources() -> list[str]:
    """Registers, spills and shared memory of every decode kernel compiled so far in this process."""
    out = []
    for fn in (triton_decode._decode_kernel, triton_decode_int4.decode_int4_kernel,
               triton_decode_swap.decode_int8_swap_kernel, triton_decode_swap4.decode_int4_swap_kernel):
        for dev_cache in getattr(fn, "device_caches", {}).values():  # none under the interpreter
            for k in dev_cache[0].values():
                out.append(f"{fn.__name__}: regs {k.n_regs} spills {k.n_spills} smem {k.metadata.shared}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes (a rehearsal)")
    ap.add_argument("--bits", type=int, default=8, choices=(16, 8, 4))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--time", action="store_true", help="also time it (CUDA graph of 20 calls, median)")
    ap.add_argument("--variants", default="", help="';'-separated override lists; '' = defaults")
    ap.add_argument("--engine-like", action="store_true",
                    help="lengths spread over [ctx/2, ctx], K/V written by the store (int4: newest blocks "
                         "staged, as in a decode step); also times the int4 quantize-on-fill kernel")
    ap.add_argument("--shuffle", action="store_true",
                    help="engine-like lengths in a random order (an engine batch's), not longest first")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    B, bs = args.batch, args.block_size
    # engine-like: one row in bs ends a block (a decode step fills about B / bs blocks)
    lens = [args.ctx - (i * args.ctx // (2 * B)) - (i % bs > 0) for i in range(B)] if args.engine_like \
        else [args.ctx] * B
    if args.shuffle:
        random.Random(0).shuffle(lens)
    cache, md = make_batch(SH, args.bits, bs, [1] * B, lens, 0, store=args.engine_like)
    staged = isinstance(cache, Int4KV)
    if args.engine_like and isinstance(cache, Int4KV):
        from nanokv.kernels.triton_blockquant import quantize_filled_graphsafe
        slots = torch.tensor([(int(md.block_tables[i, (L - 1) // bs]) * bs + (L - 1) % bs) for i, L in
                              enumerate(lens)], device=cache.k.device)
        fills = sum((L - 1) % bs == bs - 1 for L in lens)
        for w in (1, 2, 4):
            ms = timed(functools.partial(lambda i, nw: quantize_filled_graphsafe(cache, slots, nw), nw=w))
            print(f"int4 fill kernel, {w} warps, {B} tokens x {cache.num_kv_heads} heads, {fills} blocks filled: "
                  f"{ms * 1e3:.1f} us")
    first = None
    fill = slots if args.engine_like and staged else None  # (the kernel may fill as it decodes)
    for spec in args.variants.split(";"):
        torch.manual_seed(1)  # every variant gets the same queries: outputs comparable
        fn = decode_fn(cache, md, apply_overrides(default_config(), spec), fill)
        for i in range(args.calls):
            fn(i)
        out = cast(torch.Tensor, fn(0)).float()
        if first is None:
            first = out.clone()
        else:  # each variant against the first: an A/B that computes another function shows here
            err = ((out - first).norm() / first.norm()).item()
            print(f"decode_probe [{spec}]: relative difference to [{args.variants.split(';')[0]}] {err:.2e}, "
                  f"finite {bool(out.isfinite().all())}", flush=True)
        if args.time:
            ms = timed(fn)
            gbs = kv_bytes(args.bits, sum(lens)) / ms / 1e6
            print(f"decode_probe bits={args.bits} B={B} ctx={args.ctx}{' engine-like' * args.engine_like} [{spec}]: "
                  f"{ms * 1e3:.1f} us {gbs:.0f} GB/s", flush=True)
    if args.time:
        print("\n".join(compiled_resources()))
        from nanokv.kernels import cuda_decode_int4
        for name, kern in cuda_decode_int4.BUILT.items():
            print(f"nanokv_decode_int4 ({name}): {cuda_decode_int4.programs_per_sm(kern)} programs per SM")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
