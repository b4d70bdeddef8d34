"""One paged-decode shape, launched a few times: the target of a profiler run, or a quick A/B timing.

  ncu -k regex:decode --launch-skip 2 --launch-count 1 python -m nanokv.bench.decode_probe --bits 8
  NANOKV_TRITON=quant_block_n=64 python -m nanokv.bench.decode_probe --bits 8 --time

Qwen3-0.6B layer shapes (16 q heads, 8 KV heads, dim 128), bf16 queries, random codes in scattered
16-token blocks (as in nanokv.bench.gpu_kernels); the Triton config comes from NANOKV_TRITON.
"""

from __future__ import annotations

import argparse

import torch

from nanokv.bench.gpu_kernels import SH, decode_fn, kv_bytes, timed
from nanokv.kernels.triton_backend import TritonConfig, config_from_env
from nanokv.kernels.triton_selfcheck import make_batch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, default=8, choices=(16, 8, 4))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--time", action="store_true", help="also time it (CUDA graph of 20 calls, median)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cache, md = make_batch(SH, args.bits, args.block_size, [1] * args.batch, [args.ctx] * args.batch, 0,
                           store=False)
    fn = decode_fn(cache, md, config_from_env(TritonConfig()))
    for i in range(args.calls):
        fn(i)
    torch.cuda.synchronize()
    if args.time:
        ms = timed(fn)
        gbs = kv_bytes(args.bits, args.batch * args.ctx) / ms / 1e6
        print(f"decode_probe bits={args.bits} B={args.batch} ctx={args.ctx}: {ms * 1e3:.1f} us {gbs:.0f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
