"""Optional torch.compile fusion of the small elementwise chains around the matmuls.

A decode step of a small model at batch 256 is hundreds of tiny kernels (each RMSNorm alone is a
cast, a square, a mean, an rsqrt and three products); a CUDA graph removes their launch cost but
not their memory round trips. On CUDA, with fusion enabled, each chain below becomes one
generated kernel. The plain functions stay the reference path: CPU, `enforce_eager`, tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

_ENABLED = False


def set_fusion(enabled: bool) -> None:
    global _ENABLED
    _ENABLED = enabled


def fusable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run `fn` compiled (dynamic shapes: one compile serves every batch size) when fusion is on
    and the first argument lives on a GPU; otherwise as written."""
    compiled: Callable[..., Any] | None = None

    def run(*args: Any) -> Any:
        nonlocal compiled
        if _ENABLED and args[0].is_cuda:
            if compiled is None:
                compiled = torch.compile(fn, dynamic=True, fullgraph=True)
            return compiled(*args)
        return fn(*args)

    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    run.__wrapped__ = fn  # type: ignore[attr-defined]  # (tests compile it on the CPU)
    return run


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # statistics in float32, back to the model dtype *before* the weight (HF's order: bf16 rounds alike)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@fusable
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> RMSNorm(x) * weight."""
    return _rms(x, weight, eps)


@fusable
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual)."""
    s = x + residual
    return _rms(s, weight, eps), s


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # neox pairs (x[i], x[i + D/2]), each rotated by its angle; cos/sin [T, 1, D/2]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _one_buffer(q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hk, D] in `dtype` (the attention's, nanokv.kv.hooks.qk_dtype). Compiled
    (fusion on, a GPU): views of one [T, Hq + Hk, D] buffer, which one generated kernel writes (not
    one each; the norms' reductions fuse in too), so that a product both then take (a KV format's key
    rotation, nanokv.kv.rotation.maybe_rotate) is one GEMM. Run as written (CPU, eager): two tensors,
    as a cat would be a copy there."""
    if not torch.compiler.is_compiling():
        return (q, k) if q.dtype == dtype else (q.to(dtype), k.to(dtype))
    qk = torch.cat((q.to(dtype), k.to(dtype)), dim=1)  # cast first: each part's kernel writes dtype
    return qk[:, :q.shape[1]], qk[:, q.shape[1]:]


@fusable
def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] -> rotated (same shapes), in dtype."""
    return _one_buffer(_rotate(q, cos, sin), _rotate(k, cos, sin), dtype)


@fusable
def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, qw: torch.Tensor, kw: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3: per-head RMSNorm of q and k, then RoPE. q [T, Hq, D], k [T, Hk, D], returned in dtype."""
    return _one_buffer(_rotate(_rms(q, qw, eps), cos, sin), _rotate(_rms(k, kw, eps), cos, sin), dtype)


@fusable
def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2*I] = [gate | up] -> silu(gate) * up  [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
