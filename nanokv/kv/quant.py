"""Reference (torch) quantization of K/V rows, the oracle for the fused Triton kernels.

Rows are one (token, head) vector of head_dim values; each row gets its own scale (and zero
point for int4), so a block is quantized once when its tokens are written and never again.

Scales are stored as float16. A row whose range is below float16's smallest subnormal (e.g. an
all-zero or constant row) would get scale 0 and divide by zero; such a scale is stored as 1.0
instead, which gives codes 0 and reconstructs the row as 0 (int8) or its constant (int4).
"""

from __future__ import annotations

import torch


def _safe_scale(scale: torch.Tensor) -> torch.Tensor:
    """float16 scale [...] with zeros (underflow) replaced by 1.0; the kernels do the same."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] float -> (codes int8 [..., D], scale float16 [...]); symmetric."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = _safe_scale((amax / 127.0).half())
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
    scale = _safe_scale(((hi - lo) / 15.0).half())
    zero = lo.half()
    q = (xf - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)
    q = torch.round(q).clamp_(0, 15).to(torch.uint8)
    half = q.shape[-1] // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    return packed, scale, zero


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    low = (packed & 0xF).float()
    high = (packed >> 4).float()
    q = torch.cat([low, high], dim=-1)
    return (q * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).to(dtype)


def _pack(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [..., D] codes 0..15 -> [..., D/2]: dim d low nibble, d + D/2 high nibble."""
    half = q.shape[-1] // 2
    return q[..., :half] | (q[..., half:] << 4)


def quantize_int4_channels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys of whole blocks, KIVI-style: x [..., bs, D] -> (packed uint8 [..., bs, D/2], scale [..., D],
    zero [..., D]): one asymmetric scale/zero per channel over the block's bs tokens.

    Per channel, because a key channel changes slowly from token to token while channels differ by
    orders of magnitude (RoPE pairs, outlier channels): a per-token range is set by the largest
    channel, a per-channel range only by that channel's own spread within the block.
    """
    xf = x.float()
    lo = xf.amin(dim=-2)
    hi = xf.amax(dim=-2)
    scale = _safe_scale(((hi - lo) / 15.0).half())
    zero = lo.half()
    q = (xf - zero.float().unsqueeze(-2)) / scale.float().unsqueeze(-2)
    return _pack(torch.round(q).clamp_(0, 15).to(torch.uint8)), scale, zero


def dequantize_int4_channels(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                             dtype: torch.dtype) -> torch.Tensor:
    """packed [..., bs, D/2], scale and zero [..., D] -> [..., bs, D]."""
    q = torch.cat([(packed & 0xF).float(), (packed >> 4).float()], dim=-1)
    return (q * scale.float().unsqueeze(-2) + zero.float().unsqueeze(-2)).to(dtype)
