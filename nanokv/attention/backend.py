"""Attention backends: one interface, a torch reference (CPU) and Triton (GPU) implementation."""

from __future__ import annotations

from typing import Protocol

import torch

from nanokv.attention.metadata import AttentionMetadata
from nanokv.kv.cache import LayerKVCache


class AttentionBackend(Protocol):
    name: str

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                      slot_mapping: torch.Tensor) -> None: ...

    def paged_attention(self, q: torch.Tensor, cache: LayerKVCache, md: AttentionMetadata, scale: float,
                        k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor: ...


class TorchBackend:
    name = "torch"

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant  # nanokv.kernels.cpu_invariant instead of the reference

    def store_kvcache(self, k, v, cache, slot_mapping):
        from nanokv.kernels import reference
        reference.store_kvcache(k, v, cache, slot_mapping)

    def paged_attention(self, q, cache, md, scale, k=None, v=None):
        from nanokv.kernels import cpu_invariant, reference
        if self.batch_invariant:
            return cpu_invariant.paged_attention(q, cache, md, scale)
        return reference.paged_attention(q, cache, md, scale)


_BACKEND: AttentionBackend = TorchBackend()


def get_backend() -> AttentionBackend:
    return _BACKEND


def use_backend(backend: AttentionBackend) -> None:
    """Make `backend` the one the model layers call (each runner before its forward: several
    engines in one process may use different backends)."""
    global _BACKEND
    _BACKEND = backend


def set_backend(name: str, device: torch.device | str = "cpu", batch_invariant: bool = False) -> AttentionBackend:
    """Pick the backend: 'torch', 'triton', or 'auto' (triton on CUDA, torch on CPU).
    batch_invariant: the torch backend's batch-invariant attention (nanokv.kernels.cpu_invariant)."""
    global _BACKEND
    dev = torch.device(device)
    if name == "auto":
        name = "triton" if dev.type == "cuda" else "torch"
    if name == "triton":
        from nanokv.kernels.triton_backend import TritonBackend
        _BACKEND = TritonBackend()
    else:
        _BACKEND = TorchBackend(batch_invariant)
    return _BACKEND
