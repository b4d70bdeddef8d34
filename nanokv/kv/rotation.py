"""Orthonormal (randomised Hadamard) rotation of q and k before the KV store.

Why: per-token int4 keys lose most of their precision to a few large channels (RoPE pairs with big
norms). Rotating every query and key by the same orthonormal R spreads those channels over all
head_dim values, so the per-row range shrinks relative to the row norm, while attention scores are
unchanged in exact arithmetic: (q R)(k R)^T = q R R^T k^T = q k^T. The cache stores rotated keys.
int4 layers also store values rotated (v R, the format's rotate_v): the attention output is then o R,
rotated back by the hooks, or, where the engine folded R into v_proj and o_proj
(ModelRunner.fold_value_rotations), produced and consumed in that basis by the weights.

The rotation is part of a layer's KV format, fixed at start-up: it must be applied identically on
every backend (torch reference and Triton) at the one place where q/k are handed to the backend,
i.e. `model.layers.attention.Attention.forward` through `compute_service.kv_hooks.before_store`.

R = diag(s) H / sqrt(D): H the Sylvester Hadamard matrix (D a power of two), s fixed random signs
(seeded) so that structured inputs do not align with H's rows. Non-power-of-two D falls back to a
seeded random orthogonal matrix (QR).
"""

from __future__ import annotations

import torch

# Bit widths whose keys are stored rotated (measured: see docs/quality.md). 16-bit layers are
# never rotated: they gain nothing and it would cost a matmul per token.
DEFAULT_ROTATE_BITS: frozenset[int] = frozenset({8, 4})
_SEED = 0x5EED

_CACHE: dict[tuple[int, torch.dtype, str], torch.Tensor] = {}


def hadamard(n: int) -> torch.Tensor:
    """Unnormalised Sylvester Hadamard matrix [n, n] of +-1 (n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def rotation_matrix(head_dim: int, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """The fixed orthonormal R [D, D] (same on every rank and backend; cached per dtype/device)."""
    key = (head_dim, dtype, str(device))
    r = _CACHE.get(key)
    if r is None:
        g = torch.Generator().manual_seed(_SEED)
        if head_dim & (head_dim - 1) == 0:
            signs = torch.randint(0, 2, (head_dim,), generator=g).float() * 2 - 1
            base = signs.unsqueeze(1) * hadamard(head_dim) / head_dim**0.5
        else:
            base, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
        r = base.to(dtype=dtype, device=device)
        _CACHE[key] = r
    return r


def rotates(layer_bits: int, rotate: bool | None = None) -> bool:
    """Whether a layer with this bit width stores rotated keys (an explicit `rotate` wins)."""
    if rotate is not None:
        return rotate
    return layer_bits in DEFAULT_ROTATE_BITS


def maybe_rotate(q: torch.Tensor, k: torch.Tensor, layer_bits: int,
                 rotate: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] (post-RoPE) -> the same, rotated by R if this layer's format says so."""
    if not rotates(layer_bits, rotate):
        return q, k
    r = rotation_matrix(q.shape[-1], q.dtype, q.device)
    both = joint_view(q, k)
    if both is not None:  # one GEMM for both (a small one per layer and step: launches dominate)
        qk = both @ r
        return qk[:, :q.shape[1]], qk[:, q.shape[1]:]
    return q @ r, k @ r


def joint_view(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [T, Hq, D] and k [T, Hk, D] as one [T, Hq + Hk, D] tensor when k's heads directly follow q's
    in one contiguous buffer (nanokv.compute_service.model.layers.fusion makes them so on a GPU), else None."""
    T, Hq, D = q.shape
    if (k.dim() != 3 or k.shape[0] != T or k.shape[2] != D or k.dtype != q.dtype or k.device != q.device
            or q.stride() != k.stride() or q.stride()[1:] != (D, 1) or q.stride(0) != (Hq + k.shape[1]) * D
            or k.data_ptr() != q.data_ptr() + Hq * D * q.element_size()):
        return None
    return q.as_strided((T, Hq + k.shape[1], D), q.stride())
