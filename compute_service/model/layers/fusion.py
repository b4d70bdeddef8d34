"""Optional torch.compile fusion of the small elementwise chains around the matmuls.

A decode step of a small model at batch 256 is hundreds of tiny kernels (each RMSNorm alone is a
cast, a square, a mean, an rsqrt and three products); a CUDA graph removes their launch cost but
not their memory round trips. On CUDA, with fusion enabled, each chain below is one hand-written
Triton kernel (nanokv.kernels.triton_rope, nanokv.kernels.triton_norm); set_fusion(kernels=False)
makes the norms and SiLU-and-mul Inductor-generated kernels instead (torch.compile: the same device
time, more host time per call; docs/kernels.md). The plain functions stay the reference path: CPU, `enforce_eager`,
tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

_ENABLED = False
_KERNELS = True  # the norms and SiLU-and-mul as hand-written kernels (else torch.compile)


def set_fusion(enabled: bool, kernels: bool = True) -> None:
    global _ENABLED, _KERNELS
    _ENABLED, _KERNELS = enabled, kernels


def _kernel_ok(x: torch.Tensor) -> bool:
    return _ENABLED and _KERNELS and x.is_cuda


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
    return run


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # statistics in float32, back to the model dtype *before* the weight (HF's order: bf16 rounds alike)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@fusable
def _rms_norm_compiled(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms(x, weight, eps)


@fusable
def _add_rms_norm_compiled(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return _rms(s, weight, eps), s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> RMSNorm(x) * weight."""
    if _kernel_ok(x):
        from nanokv.kernels import triton_norm
        if triton_norm.supported(x, weight):
            return triton_norm.rms_norm(x, weight, eps)
    return _rms_norm_compiled(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual)."""
    if _kernel_ok(x):
        from nanokv.kernels import triton_norm
        if triton_norm.supported(x, weight, residual):
            return triton_norm.add_rms_norm(x, residual, weight, eps)
    return _add_rms_norm_compiled(x, residual, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # neox pairs (x[i], x[i + D/2]), each rotated by its angle; cos/sin [T, 1, D/2]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _head_weight(qw: torch.Tensor, kw: torch.Tensor, hq: int, h: int) -> torch.Tensor:
    """[h, D]: q's norm weight on the first hq heads, k's on the rest."""
    return torch.where(torch.arange(h, device=qw.device).unsqueeze(1) < hq, qw, kw)


def _on_gpu_kernel(qk: torch.Tensor) -> bool:
    # the hand-written kernel (nanokv.kernels.triton_rope) where the other fusions would compile:
    # Inductor made two or three kernels of q's and k's norm + RoPE, or one slow one of them joined
    return _ENABLED and qk.is_cuda


def _times(x: torch.Tensor, rot: torch.Tensor | None) -> torch.Tensor:
    return x if rot is None else x @ rot


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype,
         rot: torch.Tensor | None = None) -> torch.Tensor:
    """qk [T, Hq + Hk, D] (q's heads, then k's) -> rotated, in dtype: one new [T, Hq + Hk, D] tensor
    (then times rot [D, D] in dtype, a KV format's rotation of q and k, when given)."""
    if _on_gpu_kernel(qk):
        from nanokv.kernels import triton_rope
        return triton_rope.qk_norm_rope(qk, cos, sin, dtype, rot=rot)
    return _times(_rotate(qk, cos, sin).to(dtype), rot)


def qk_norm_rope(qk: torch.Tensor, qw: torch.Tensor, kw: torch.Tensor, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor, dtype: torch.dtype, hq: int, rot: torch.Tensor | None = None) -> torch.Tensor:
    """Qwen3: per-head RMSNorm (q's weight on the first hq heads, k's on the rest), then RoPE.

    qk [T, Hq + Hk, D] (e.g. a view of the qkv projection's output) -> one new [T, Hq + Hk, D]
    tensor in dtype (the attention's, nanokv.compute_service.kv_hooks.qk_dtype). q and k as one tensor: on a GPU
    that is one kernel launch for both, and the heads stay adjacent, so a product both then take (a
    KV format's key rotation, nanokv.kv.rotation.maybe_rotate) is one GEMM, or, given as rot, is
    applied here (on a GPU inside the same kernel)."""
    if _on_gpu_kernel(qk):
        from nanokv.kernels import triton_rope
        return triton_rope.qk_norm_rope(qk, cos, sin, dtype, (qw, kw, eps, hq), rot)
    return _times(_rotate(_rms(qk, _head_weight(qw, kw, hq, qk.shape[1]), eps), cos, sin).to(dtype), rot)


@fusable
def _silu_mul_compiled(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2*I] = [gate | up] -> silu(gate) * up  [T, I]."""
    if _kernel_ok(x):
        from nanokv.kernels import triton_norm
        return triton_norm.silu_mul(x)
    return _silu_mul_compiled(x)
