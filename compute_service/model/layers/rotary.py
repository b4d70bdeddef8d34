"""Rotary position embedding, neox style (rotate the two halves of each head, as HF Llama does).

The cos/sin table is computed once in float32 for every position up to max_position, so a step
only gathers rows by `positions` (any order, any mix of sequences) with no per-token Python.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from nanokv.compute_service.model.layers.fusion import rope
from nanokv.errors import NanoKVError


def rope_inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] float32, with the configured scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base ** exponents)
    s = scaling or {}
    rtype = s.get("rope_type", "default")
    if rtype == "default":
        return inv_freq
    if rtype == "linear":  # position interpolation: every position divided by `factor`
        return inv_freq / float(s["factor"])
    if rtype == "freq_factors":  # llama.cpp's rope_freqs tensor: per-pair divisors
        factors = torch.tensor(s["factors"], dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise NanoKVError("rope_scaling", f"{factors.numel()} freq factors for {inv_freq.numel()} pairs")
        return inv_freq / factors
    if rtype == "llama3":
        return _llama3_inv_freq(inv_freq, s)
    raise NanoKVError("rope_scaling", f"rope_type {rtype!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.

    A pair's wavelength 2*pi/f is compared with the original context: pairs that complete fewer
    than `low_freq_factor` turns over it are interpolated, those with more than `high_freq_factor`
    turns stay as they are, and in between the two are blended linearly in turns.
    """
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    turns = old_ctx * inv_freq / (2 * math.pi)  # = old_ctx / wavelength
    blend = ((turns - low) / (high - low)).clamp(0.0, 1.0)  # 0: fully scaled, 1: untouched
    scaled = inv_freq / factor
    out = (1.0 - blend) * scaled + blend * inv_freq
    # exact at the ends, as the reference formula
    out = torch.where(turns < low, scaled, out)
    return torch.where(turns > high, inv_freq, out)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = rope_inv_freq(head_dim, base, rope_scaling)
        angles = torch.arange(max_position, dtype=torch.float32).unsqueeze(1) * inv_freq  # [P, D/2]
        # [P, D]: cos | sin of each pair's angle; float32 so bf16 models keep accurate angles
        self.register_buffer("cos_sin_cache", torch.cat([angles.cos(), angles.sin()], dim=-1),
                             persistent=False)

    cos_sin_cache: torch.Tensor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, 1, D/2] each in `dtype`; computed once per step and
        shared by every layer (see rotate)."""
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(dtype)  # [T, D]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    @staticmethod
    def rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype | None = None,
               rot: torch.Tensor | None = None) -> torch.Tensor:
        """qk [T, H, D] (e.g. q's heads then k's) rotated by cos/sin from `cos_sin`, a new tensor of
        the same shape (dtype: the output's, default qk's; rot: see fusion.rope)."""
        return rope(qk, cos, sin, dtype or qk.dtype, rot)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, D], k [T, Hk, D] -> rotated q, k (same shapes and dtype)."""
        qk = self.rotate(torch.cat((q, k), dim=1), *self.cos_sin(positions, q.dtype))
        return qk[:, :q.shape[1]], qk[:, q.shape[1]:]
