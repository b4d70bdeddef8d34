"""One paged-decode shape, launched a few times: the target of a profiler run, or quick A/B timings.

  ncu -k regex:decode --launch-skip 2 --launch-count 1 python -m nanokv.bench.decode_probe --bits 8
  python -m nanokv.bench.decode_probe --bits 8 --time --variants "quant_stages=1;quant_block_n=64"

Qwen3-0.6B layer shapes (16 q heads, 8 KV heads, dim 128), bf16 queries, random codes in scattered
16-token blocks (as in nanokv.bench.gpu_kernels). Each variant is a TritonConfig override list
(NANOKV_TRITON syntax) applied on top of NANOKV_TRITON; "" is the default config.
"""

from __future__ import annotations

import argparse

import torch

from nanokv.bench.gpu_kernels import SH, decode_fn, kv_bytes, timed
from nanokv.kernels import triton_decode, triton_decode_int4
from nanokv.kernels.triton_backend import TritonConfig, apply_overrides, config_from_env
from nanokv.kernels.triton_selfcheck import make_batch


def compiled_resources() -> list[str]:
    """Registers, spills and shared memory of every decode kernel compiled so far in this process."""
    out = []
    for fn in (triton_decode._decode_kernel, triton_decode_int4.decode_int4_kernel):
        for dev_cache in fn.device_caches.values():
            for k in dev_cache[0].values():
                out.append(f"{fn.__name__}: regs {k.n_regs} spills {k.n_spills} smem {k.metadata.shared}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, default=8, choices=(16, 8, 4))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--time", action="store_true", help="also time it (CUDA graph of 20 calls, median)")
    ap.add_argument("--variants", default="", help="';'-separated override lists; '' = defaults")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cache, md = make_batch(SH, args.bits, args.block_size, [1] * args.batch, [args.ctx] * args.batch, 0,
                           store=False)
    for spec in args.variants.split(";"):
        fn = decode_fn(cache, md, apply_overrides(config_from_env(TritonConfig()), spec))
        for i in range(args.calls):
            fn(i)
        torch.cuda.synchronize()
        if args.time:
            ms = timed(fn)
            gbs = kv_bytes(args.bits, args.batch * args.ctx) / ms / 1e6
            print(f"decode_probe bits={args.bits} B={args.batch} ctx={args.ctx} [{spec}]: "
                  f"{ms * 1e3:.1f} us {gbs:.0f} GB/s", flush=True)
    if args.time:
        print("\n".join(compiled_resources()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
