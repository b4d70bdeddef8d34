"""Reference (torch) quantization of K/V rows, the oracle for the fused Triton kernels.

Rows are one (token, head) vector of head_dim values; each row gets its own scale (and zero
point for int4), so a block is quantized once when its tokens are written and never again.
"""

from __future__ import annotations

import torch


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] float -> (codes int8 [..., D], scale float16 [...]); symmetric."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(1e-8)
    scale = (amax / 127.0).half()
    codes = torch.round(xf / scale.float().unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.float().unsqueeze(-1)).to(dtype)


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [..., D] float -> (packed uint8 [..., D/2], scale [...], zero [...]); asymmetric.

    Dim d goes to the low nibble and d + D/2 to the high one, so unpacking yields two contiguous
    half rows with no shuffles.
    """
    xf = x.float()
    lo = xf.amin(dim=-1)
    hi = xf.amax(dim=-1)
    scale = ((hi - lo).clamp_min(1e-8) / 15.0).half()
    zero = lo.half()
    q = torch.round((xf - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    half = q.shape[-1] // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    return packed, scale, zero


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    low = (packed & 0xF).float()
    high = (packed >> 4).float()
    q = torch.cat([low, high], dim=-1)
    return (q * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).to(dtype)
