"""Vocab-parallel token embedding and LM head (rows of the vocab split across TP ranks).

At tp N the vocab is padded up to a multiple of N; rank r holds rows [r*V/N, (r+1)*V/N). Padded
rows are zero and the padded logits are cut off, so nothing outside the real vocab is visible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanokv.compute_service.distributed import all_gather, all_reduce, get_tp_rank, get_tp_size
from nanokv.compute_service.model.layers.linear import matmul_for, pad_rows
from nanokv.errors import NanoKVError

_CPU_PANEL_ROWS = 1024  # vocab rows per LM-head matmul on the CPU (see ParallelLMHead.forward)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // self.tp_size)  # ceil: rows per rank
        self.start = self.tp_rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: object = None) -> None:
        if full.shape[0] != self.vocab_size or full.shape[1:] != param.shape[1:]:
            raise NanoKVError("weights", f"embedding: checkpoint shape {tuple(full.shape)}, model expects "
                              f"({self.vocab_size}, {param.shape[1]})")
        n = max(0, min(self.rows, self.vocab_size - self.start))
        param.data[:n].copy_(full.narrow(0, self.start, n))
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> embeddings [T, hidden]."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.rows)
        y = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden @ W.T with W [vocab, hidden] sharded like the embedding."""

    def tie_to(self, embed: VocabParallelEmbedding) -> None:
        """Share the embedding's Parameter (tie_word_embeddings): loaded once, stored once."""
        self.weight = embed.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] (model dtype; every rank gets all of them)."""
        if hidden.device.type == "cpu":
            # in panels of vocab rows: one sgemm over all ~50k rows runs at a fraction of the speed
            # of the same work in 1024-row panels whose output stays in cache (1.5x on a decode
            # batch of 16). Each logit is the same dot product, so the result is unchanged.
            hp, mm = pad_rows(hidden), matmul_for(hidden)
            logits = torch.cat([mm(hp, w) for w in self.weight.split(_CPU_PANEL_ROWS)], dim=-1)
            logits = logits[: hidden.shape[0]]
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = all_gather(logits, dim=-1)[:, : self.vocab_size]
        return logits
