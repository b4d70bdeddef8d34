"""Drive a nanokv model directly through the paged KV cache, without engine or runner.

`build_metadata` packs sequences the way the ModelRunner does (prefills first, then decodes) so
tests of the model, kernels and eval can share one hand-built, readable version of it.
Blocks are handed out in a scrambled order so that a test passes only if paging really works.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanokv.compute_service.kv_hooks import LayerHooks
from nanokv.kv.cache import LayerKV, allocate_layer_cache
from nanokv.kv.metadata import AttentionMetadata, forward_context


@dataclass
class SeqStep:
    num_cached: int  # tokens already in the cache
    num_new: int  # tokens computed this step
    block_table: list[int]  # physical block ids covering at least num_cached + num_new tokens
    is_prefill: bool = True


def make_caches(model_config, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                device: str = "cpu", bits: int | list[int] = 16, tp_size: int = 1,
                tp_rank: int = 0) -> list[LayerKV]:
    """One KV object per layer (bits: one width for all layers or a per-layer list)."""
    _, kv_heads = model_config.heads_per_rank(tp_size, tp_rank)
    n = model_config.num_hidden_layers
    plan = [bits] * n if isinstance(bits, int) else list(bits)
    return [allocate_layer_cache(b, num_blocks, kv_heads, block_size, model_config.head_dim, dtype, device)
            for b in plan]


def scrambled_blocks(n: int, num_blocks: int, seed: int = 0) -> list[int]:
    """n distinct block ids out of num_blocks, in a seeded random order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=g)[:n].tolist()


def build_metadata(seqs: list[SeqStep], block_size: int, device: str = "cpu") -> AttentionMetadata:
    """AttentionMetadata for one step; prefill sequences must come before decode ones."""
    flags = [s.is_prefill for s in seqs]
    if flags != sorted(flags, reverse=True):
        raise ValueError("prefill sequences must come first")
    qsl, seq_lens, slots = [0], [], []
    for s in seqs:
        qsl.append(qsl[-1] + s.num_new)
        seq_lens.append(s.num_cached + s.num_new)
        for pos in range(s.num_cached, s.num_cached + s.num_new):
            slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
    width = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [-1] * (width - len(s.block_table)) for s in seqs]
    num_prefills = sum(flags)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        num_prefills=num_prefills,
        num_prefill_tokens=qsl[num_prefills],
        num_decode_tokens=qsl[-1] - qsl[num_prefills],
        max_query_len=max(s.num_new for s in seqs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )


class PagedRunner:
    """One sequence at a time through a model and its paged caches (prefill, then decodes)."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = 16, bits: int | list[int] = 16,
                 device: str = "cpu", seed: int = 0):
        self.model = model
        self.block_size = block_size
        self.device = device
        dtype = next(model.parameters()).dtype
        self.caches = make_caches(model.config, num_blocks, block_size, dtype, device, bits,
                                  tp_size=getattr(model, "tp_size", 1), tp_rank=getattr(model, "tp_rank", 0))
        self.hooks = [LayerHooks() for _ in self.caches]  # (none attached: a test may)
        self.blocks = scrambled_blocks(num_blocks, num_blocks, seed)

    @torch.inference_mode()
    def step(self, token_ids: list[int], num_cached: int, is_prefill: bool) -> torch.Tensor:
        """Run `token_ids` at positions num_cached.. -> float32 logits [len(token_ids), vocab]."""
        n = len(token_ids)
        nb = -(-(num_cached + n) // self.block_size)
        seq = SeqStep(num_cached, n, self.blocks[:nb], is_prefill)
        md = build_metadata([seq], self.block_size, self.device)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        pos = torch.arange(num_cached, num_cached + n, dtype=torch.int64, device=self.device)
        with forward_context(md, self.caches, hooks=self.hooks):
            hidden = self.model(ids, pos)
        return self.model.compute_logits(hidden)

    def greedy(self, prompt: list[int], max_new_tokens: int, eos: set[int] | None = None) -> list[int]:
        """Prefill the prompt, then decode one token per step; stops after an eos token."""
        logits = self.step(prompt, 0, True)
        out = [int(logits[-1].argmax())]
        while len(out) < max_new_tokens and not (eos and out[-1] in eos):
            logits = self.step([out[-1]], len(prompt) + len(out) - 1, False)
            out.append(int(logits[-1].argmax()))
        return out
