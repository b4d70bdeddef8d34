"""SiluAndMul: the SwiGLU gate on the fused gate_up projection output."""

from __future__ import annotations

import torch
from torch import nn

from nanokv.compute_service.model.layers.fusion import silu_mul


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2*I] = [gate | up] -> silu(gate) * up  [T, I]."""
        return silu_mul(x)
