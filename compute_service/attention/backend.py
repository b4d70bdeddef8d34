"""Attention backends: one interface, a torch reference (CPU) and Triton (GPU) implementation."""

from __future__ import annotations

from typing import Protocol

import torch

from nanokv.kv.cache import LayerKV
from nanokv.kv.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                      slot_mapping: torch.Tensor) -> None: ...

    def paged_attention(self, q: torch.Tensor, cache: LayerKV, md: AttentionMetadata, scale: float,
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


REFERENCE: AttentionBackend = TorchBackend()  # for forward contexts that name no backend (tests)


def make_backend(name: str, device: torch.device | str = "cpu", batch_invariant: bool = False) -> AttentionBackend:
    """The backend for 'torch', 'triton', or 'auto' (triton on CUDA, torch on CPU); a runner passes
    it to each forward through nanokv.kv.metadata.forward_context.
    batch_invariant: the torch backend's batch-invariant attention (nanokv.kernels.cpu_invariant)."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "triton":
        from nanokv.kernels.triton_backend import TritonBackend
        return TritonBackend()
    return TorchBackend(batch_invariant)
