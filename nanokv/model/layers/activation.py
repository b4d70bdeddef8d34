"""SiluAndMul: the SwiGLU gate on the fused gate_up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2*I] = [gate | up] -> silu(gate) * up  [T, I]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
