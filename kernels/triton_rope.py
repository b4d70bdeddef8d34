"""q/k RMSNorm (Qwen3) + RoPE + cast in one Triton kernel, over q's and k's heads as one tensor.

One program per token (TritonConfig.rope_tokens in long steps with a rotation) reads its [H, D] rows of q then k
heads (H = Hq + Hk; a strided view of the qkv projection's output), normalizes each head, rotates
it and writes [H, D] in the attention's dtype. In a CUDA-graphed decode step this is one launch
per layer: Inductor's fusion of the same function took two or three kernels, and its single-kernel
form of the joint tensor was slower still (docs/kernels.md, "Prefill, fill, store, RoPE and norms").

Roundings follow the compiled torch function (nanokv.compute_service.model.layers.fusion, fp32 inside a kernel):
the normalized row is rounded to the input dtype before the weight (HF's order), the weighted row
again, and the rotation is computed in fp32 and rounded once to the output dtype.

Optionally (`rot`) the same program multiplies the rows by a KV format's rotation R [D, D]
(nanokv.kv.rotation: q and k of int8/int4 layers), with the rounding of the GEMM it replaces
(input in the output dtype, fp32 sums, one rounding): one launch less per layer and step.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nanokv.kernels.triton_config import TritonConfig, apply_overrides, overrides


@triton.jit
def _rotate_halves(a, b, r_ptr, offs_d, d_ok, DH: tl.constexpr, PREC: tl.constexpr):
    """[a | b] @ R for R [2 DH, 2 DH] (row-major) -> its two halves, fp32: y1 = a R11 + b R21,
    y2 = a R12 + b R22. a, b: [BLOCK_H, BLOCK_DH] in the output dtype (rounded as the GEMM's input)."""
    m = d_ok[:, None] & d_ok[None, :]
    rr = r_ptr + offs_d[:, None] * (2 * DH) + offs_d[None, :]
    r11 = tl.load(rr, mask=m, other=0.0)
    r12 = tl.load(rr + DH, mask=m, other=0.0)
    r21 = tl.load(rr + DH * 2 * DH, mask=m, other=0.0)
    r22 = tl.load(rr + DH * 2 * DH + DH, mask=m, other=0.0)
    y1 = tl.dot(b, r21, tl.dot(a, r11, input_precision=PREC), input_precision=PREC)
    y2 = tl.dot(b, r22, tl.dot(a, r12, input_precision=PREC), input_precision=PREC)
    return y1, y2


@triton.jit
def _qk_norm_rope_kernel(x_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, r_ptr, o_ptr,
                         stride_xt, stride_xh, stride_ct, stride_st, eps, HQ, H, T,
                         DH: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DH: tl.constexpr, NORM: tl.constexpr,
                         ROT: tl.constexpr, PREC: tl.constexpr, TOK: tl.constexpr):
    # rows r of a program: token t0 + r // BLOCK_H, head r % BLOCK_H (TOK tokens, BLOCK_H rows each)
    offs_r = tl.arange(0, TOK * BLOCK_H)
    t0 = tl.program_id(0).to(tl.int64) * TOK
    t = t0 + offs_r // BLOCK_H  # [R]
    offs_h = offs_r % BLOCK_H
    offs_d = tl.arange(0, BLOCK_DH)
    d_ok = offs_d < DH
    m2 = ((offs_h < H) & (t < T))[:, None] & d_ok[None, :]
    xr = x_ptr + t[:, None] * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(xr, mask=m2, other=0.0)  # [R, BLOCK_DH]: dims [0, D/2) of each head
    x2 = tl.load(xr + DH, mask=m2, other=0.0)  # dims [D/2, D): the rotation's pairs (i, i + D/2)
    xdt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if NORM:
        ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * DH)  # [R]
        r = (1.0 / tl.sqrt_rn(ms + eps))[:, None]
        is_q = (offs_h < HQ)[:, None]
        w1 = tl.where(is_q, tl.load(qw_ptr + offs_d, mask=d_ok, other=0.0)[None, :],
                      tl.load(kw_ptr + offs_d, mask=d_ok, other=0.0)[None, :]).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qw_ptr + DH + offs_d, mask=d_ok, other=0.0)[None, :],
                      tl.load(kw_ptr + DH + offs_d, mask=d_ok, other=0.0)[None, :]).to(tl.float32)
        x1 = ((x1 * r).to(xdt).to(tl.float32) * w1).to(xdt).to(tl.float32)
        x2 = ((x2 * r).to(xdt).to(tl.float32) * w2).to(xdt).to(tl.float32)
    if TOK == 1:  # one token: its cos/sin row broadcast over the heads
        c = tl.load(cos_ptr + t0 * stride_ct + offs_d, mask=d_ok, other=0.0)[None, :]
        s = tl.load(sin_ptr + t0 * stride_st + offs_d, mask=d_ok, other=0.0)[None, :]
    else:
        c = tl.load(cos_ptr + t[:, None] * stride_ct + offs_d[None, :], mask=m2, other=0.0)
        s = tl.load(sin_ptr + t[:, None] * stride_st + offs_d[None, :], mask=m2, other=0.0)
    c = c.to(tl.float32)
    s = s.to(tl.float32)
    odt = o_ptr.dtype.element_ty
    y1 = (x1 * c - x2 * s).to(odt)
    y2 = (x2 * c + x1 * s).to(odt)
    if ROT:  # the KV format's rotation of q and k (nanokv.kv.rotation), as its GEMM on these rows would
        y1, y2 = _rotate_halves(y1, y2, r_ptr, offs_d, d_ok, DH, PREC)
    orow = o_ptr + t[:, None] * H * 2 * DH + offs_h[:, None] * (2 * DH) + offs_d[None, :]
    tl.store(orow, y1.to(odt), mask=m2)
    tl.store(orow + DH, y2.to(odt), mask=m2)


MANY_TOKENS = 1024  # steps at least this long (with a rotation) take tokens_per_program() per program


def tokens_per_program() -> int:
    return _tokens_for(overrides())


@functools.cache
def _tokens_for(spec: str) -> int:
    return max(1, apply_overrides(TritonConfig(), spec).rope_tokens)


def qk_norm_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype,
                 norm: tuple[torch.Tensor, torch.Tensor, float, int] | None = None,
                 rot: torch.Tensor | None = None, tokens: int = 0) -> torch.Tensor:
    """qk [T, H, D] (last dim contiguous; q's heads then k's) -> [T, H, D] in dtype, rotated by
    cos/sin [T, 1, D/2] (nanokv.compute_service.model.layers.rotary.cos_sin); norm = (q weight [D], k weight [D],
    eps, Hq) first normalizes each head, q's weight on the first Hq heads; rot [D, D] (in dtype)
    then multiplies every head (a KV format's rotation of q and k), its input rounded to dtype.
    tokens: per program (0 = by T, see MANY_TOKENS)."""
    T, H, D = qk.shape
    out = torch.empty((T, H, D), dtype=dtype, device=qk.device)
    if T == 0:
        return out
    if qk.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("qk_norm_rope: qk, cos and sin need a contiguous last dim")
    if rot is not None:
        if rot.shape != (D, D) or rot.dtype != dtype:
            raise ValueError(f"qk_norm_rope: rot must be a [{D}, {D}] {dtype} matrix, got {tuple(rot.shape)} "
                             f"{rot.dtype}")
        rot = rot.contiguous()  # (a QR rotation, for head dims not a power of two, comes column-major)
    qw, kw, eps, hq = norm if norm is not None else (qk, qk, 0.0, H)  # (not read without NORM)
    # the rotation's dots need >= 16 rows and inner size (padding rows and dims are masked)
    bh, bd = triton.next_power_of_2(H), triton.next_power_of_2(D // 2)
    if rot is not None:
        bh, bd = max(bh, 16), max(bd, 16)
    # long (prefill) steps with a rotation: several tokens per program, so each reads R once for all
    # (H200, 16k tokens, Qwen3 shapes: 1 / 2 / 4 / 8 tokens 133.9 / 151.8 / 98.6 / 131.8 us with R;
    # without, 56.3 / 57.8 / 75.0 / 84.9 us, so one)
    tok = tokens or (tokens_per_program() if T >= MANY_TOKENS and rot is not None else 1)
    _qk_norm_rope_kernel[(triton.cdiv(T, tok),)](
        qk, qw, kw, cos, sin, rot if rot is not None else qk, out, qk.stride(0), qk.stride(1), cos.stride(0),
        sin.stride(0), float(eps), hq, H, T, DH=D // 2, BLOCK_H=bh, BLOCK_DH=bd, NORM=norm is not None,
        ROT=rot is not None, PREC="ieee" if dtype == torch.float32 else "tf32", TOK=tok,
        num_warps=4 if tok == 1 else 8)
    return out
