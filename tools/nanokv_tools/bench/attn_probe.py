"""Fresh-prompt prefill attention on a GPU, flash (varlen) against cuDNN: `python -m nanokv_tools.bench.attn_probe`.

A long-context prefill step packs a few whole prompts (16,384 tokens of ~2,000-4,000 each) and
attends over them causally with GQA (16 query heads, 8 KV heads, dim 128: Qwen3-0.6B). This times
one such call per backend torch offers and prints its largest difference to flash.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F


def _timed(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hq", type=int, default=16)
    ap.add_argument("--hk", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    lens: list[int] = []
    while sum(lens) < args.tokens:
        lens.append(min(rng.randint(2048, 4096), args.tokens - sum(lens)))
    G = args.hq // args.hk
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda")
    for dt in (torch.bfloat16, torch.float16):
        _probe(args, dt, lens, cu, G)
    return 0


def _probe(args: argparse.Namespace, dt: torch.dtype, lens: list[int], cu: torch.Tensor, G: int) -> None:
    T, mx, scale = sum(lens), max(lens), args.dim ** -0.5
    if True:
        q = torch.randn(T, args.hq, args.dim, device="cuda", dtype=dt)
        k = torch.randn(T, args.hk, args.dim, device="cuda", dtype=dt)
        v = torch.randn(T, args.hk, args.dim, device="cuda", dtype=dt)

        def flash():
            return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False,
                                                           scale=scale)[0]

        def cudnn_varlen():
            return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, mx, mx, False, 0.0, True,
                                                           False, scale=scale)[0]

        def cudnn_varlen_expanded():
            kk, vv = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
            return torch.ops.aten._cudnn_attention_forward(q, kk, vv, None, cu, cu, mx, mx, False, 0.0, True,
                                                           False, scale=scale)[0]

        def per_seq(backend):
            def run():
                out = torch.empty_like(q)
                qsl = cu.tolist()
                for i in range(len(lens)):
                    s, e = qsl[i], qsl[i + 1]
                    with torch.nn.attention.sdpa_kernel(backend):
                        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None],
                                                           v[s:e].transpose(0, 1)[None], is_causal=True, scale=scale,
                                                           enable_gqa=True)
                    out[s:e] = o[0].transpose(0, 1)
                return out
            return run

        ref = flash()
        flops = sum(4 * n * n / 2 * args.dim * args.hq for n in lens)
        B = torch.nn.attention.SDPBackend
        for name, fn in (("flash varlen", flash), ("cudnn varlen", cudnn_varlen),
                         ("cudnn varlen, heads expanded", cudnn_varlen_expanded),
                         ("sdpa per sequence, cudnn", per_seq(B.CUDNN_ATTENTION)),
                         ("sdpa per sequence, flash", per_seq(B.FLASH_ATTENTION))):
            try:
                out = fn()
                diff = (out.float() - ref.float()).abs().max().item()
                ms = _timed(fn)
                print(f"attn_probe {str(dt)[6:]} T={T} prompts={len(lens)} {name}: {ms * 1e3:.1f} us, "
                      f"{flops / ms / 1e9:.0f} TFLOP/s, max diff to flash {diff:.2e}", flush=True)
            except Exception as e:  # noqa: BLE001 - a probe: report what this build cannot do and go on
                print(f"attn_probe {str(dt)[6:]} {name}: unavailable ({type(e).__name__}: {str(e)[:200]})",
                      flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
