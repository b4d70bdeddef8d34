"""RMSNorm (with the residual add) and SiLU-and-mul as hand-written Triton kernels.

Inductor's fusions of the same functions (nanokv.compute_service.model.layers.fusion) run as fast on the device,
but each call of a compiled function costs the host its guard and wrapper layers: three per layer
and step, ~85 calls per prefill step of Qwen3-0.6B, and long-context prefill steps are host-bound
(the host took longer to launch a 16k-token step than the device took to run it; docs/kernels.md,
"Host time"). A Triton launch is the cheaper call. Decode steps replay CUDA graphs either way.

Roundings follow the torch functions: the residual sum rounded to the model dtype, the normalized
row rounded before the weight (HF's order), the weighted row again; silu(gate) rounded before the
product with up. Statistics and products in fp32 inside.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_kernel(x_ptr, r_ptr, w_ptr, o_ptr, s_ptr, stride_x, stride_r, stride_o, stride_s, N, eps,
                BLOCK: tl.constexpr, ADD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + t * stride_x + offs, mask=ok, other=0.0)
    if ADD:  # s = x + residual in the model dtype; the norm reads s
        r = tl.load(r_ptr + t * stride_r + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(s_ptr + t * stride_s + offs, x, mask=ok)
    xf = x.to(tl.float32)
    ms = tl.sum(xf * xf, axis=0) / N
    y = (xf * (1.0 / tl.sqrt_rn(ms + eps))).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    tl.store(o_ptr + t * stride_o + offs, (w.to(tl.float32) * y.to(tl.float32)).to(o_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(x_ptr, o_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    g = tl.load(x_ptr + t * stride_x + offs, mask=ok, other=0.0)
    u = tl.load(x_ptr + t * stride_x + I + offs, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    sg = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(o_ptr + t * stride_o + offs, (sg.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] -> [T, N] view (a copy only when the rows are not evenly strided)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def supported(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Shapes the kernels take: one dtype throughout, rows up to 16k wide (one program per row)."""
    return (weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
            and x.shape[-1] == weight.shape[0] and x.shape[-1] <= 16384 and weight.stride(0) == 1)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
          out: torch.Tensor, s: torch.Tensor) -> None:
    N = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    T = x2.shape[0]
    if T:
        block = triton.next_power_of_2(N)
        _rms_kernel[(T,)](x2, r2, weight, out, s, x2.stride(0), r2.stride(0), N, N, N, float(eps), BLOCK=block,
                          ADD=residual is not None, num_warps=max(1, min(8, block // 256)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> RMSNorm(x) * weight, x's shape."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm(x, weight, eps, None, out, out)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., N] -> (RMSNorm(x + residual) * weight, x + residual)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm(x, weight, eps, residual, out, s)
    return out, s


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 I] = [gate | up] -> silu(gate) * up [..., I]."""
    x2 = _rows(x)
    T, I = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((*x.shape[:-1], I), dtype=x.dtype, device=x.device)
    if T and I:
        block = min(1024, triton.next_power_of_2(I))
        _silu_mul_kernel[(T, triton.cdiv(I, block))](x2, out, x2.stride(0), I, I, BLOCK=block, num_warps=4)
    return out
