"""Per-step attention metadata, built once per step by the ModelRunner.

The model never sees sequences or blocks: each Attention layer reads this object (through
`get_context()`) plus its own layer's KV cache, so model code stays `forward(positions, hidden)`.

Token layout of one step (T tokens in all, B sequences): sequences are packed back to back,
prefill (or chunked-prefill) sequences first, then decode sequences (one query token each).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from nanokv.kv.cache import LayerKV

if TYPE_CHECKING:
    from nanokv.compute_service.attention.backend import AttentionBackend
    from nanokv.compute_service.kv_hooks import LayerHooks


@dataclass
class AttentionMetadata:
    # [T] int64: cache slot (block_id * block_size + offset) for each new token's K/V; -1 = don't store
    slot_mapping: torch.Tensor
    # [B + 1] int32: start of each sequence's query tokens in the packed batch
    query_start_loc: torch.Tensor
    # [B] int32: tokens in each sequence's context after this step (cached + new)
    seq_lens: torch.Tensor
    # [B, max_blocks] int32: physical block ids, padded with -1. Entry i always covers positions
    # [i*block_size, (i+1)*block_size); a dropped block (sparsity) is a -1 hole, so positions stay true;
    # -2 - j is slot j of hybrid sparsity's INT4 demotion store (nanokv.kv.demote)
    block_tables: torch.Tensor
    num_prefills: int  # sequences [0, num_prefills) are prefills, the rest decode (1 token each)
    num_prefill_tokens: int
    num_decode_tokens: int
    max_query_len: int
    max_seq_len: int
    # host copies for the CPU reference path (avoid device syncs)
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # extra per-step information for backends (e.g. attention-mass accumulation for sparsity) and
    # the runner (the sampled rows' token index, ModelRunner.build_metadata)
    extras: dict[str, Any] = field(default_factory=dict)
    # set by a backend whose attention launch also quantized the int4 blocks this step fills, in the
    # layer it just computed (nanokv.kernels.cuda_decode_int4, fill_slots); read and cleared by that
    # layer's after_attention (nanokv.compute_service.kv_hooks), which then skips its own fill launch.
    # Layers run one after another, so one flag serves them all.
    fills_quantized: bool = False

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.num_prefills == 0

    def decode_order(self) -> torch.Tensor:
        """[num_seqs - num_prefills] int64: the decode rows, longest context first. Computed by the
        first layer that asks and kept in `extras` for the others (one argsort per step; under a CUDA
        graph it is part of the graph, which must therefore be captured with fresh metadata)."""
        order = self.extras.get("decode_order")
        if order is None:
            order = self.extras["decode_order"] = torch.argsort(self.seq_lens[self.num_prefills:], descending=True)
        return order


@dataclass
class ForwardContext:
    metadata: AttentionMetadata | None
    kv_caches: list[LayerKV]  # one per layer (see nanokv.kv.cache)
    # the runner's attention backend (None: the torch reference) and batch invariance (CPU linear
    # layers pad their rows, nanokv.compute_service.model.layers.linear): per forward, so several engines in one
    # process never see each other's choice
    backend: AttentionBackend | None = None
    batch_invariant: bool = False
    # each layer's run-time hooks (the runner's, nanokv.compute_service.kv_hooks.LayerHooks): a
    # forward with metadata reads them; none for profiling forwards, which store nothing
    hooks: Sequence[LayerHooks] = ()


_CONTEXT: ForwardContext | None = None


def get_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context set; the ModelRunner must enter forward_context() first")
    return _CONTEXT


def current_context() -> ForwardContext | None:
    """The context of the forward in progress, if any (layers usable outside a forward ask this)."""
    return _CONTEXT


@contextmanager
def forward_context(metadata: AttentionMetadata | None, kv_caches: list[LayerKV],
                    backend: AttentionBackend | None = None, batch_invariant: bool = False,
                    hooks: Sequence[LayerHooks] = ()):
    global _CONTEXT
    prev = _CONTEXT
    _CONTEXT = ForwardContext(metadata, kv_caches, backend, batch_invariant, hooks)
    try:
        yield _CONTEXT
    finally:
        _CONTEXT = prev
