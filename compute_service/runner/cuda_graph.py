"""CUDA graphs for decode-only steps, captured once per batch-size bucket.

A decode step of a small model is hundreds of tiny kernel launches; replaying a captured graph
removes their launch gaps. Every graph reads the same static input buffers, so a replay is: copy
this step's inputs into the buffers' first B rows, pad the rest of the bucket, replay, read the
first B rows of the hidden-state buffer. Padded rows have slot -1 (nothing stored) and attend to
one token of block 0 (harmless, discarded).
"""

from __future__ import annotations

import logging

import torch

from nanokv.compute_service.attention.backend import AttentionBackend
from nanokv.compute_service.kv_hooks import LayerHooks
from nanokv.kv.cache import LayerKV
from nanokv.kv.metadata import AttentionMetadata, forward_context

log = logging.getLogger(__name__)


def bucket_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[LayerKV], hooks: list[LayerHooks],
                 backend: AttentionBackend, hidden_size: int, max_bs: int, max_blocks: int, max_model_len: int,
                 dtype: torch.dtype, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.hooks = hooks
        self.backend = backend  # the kernels a graph captures are this backend's
        self.sizes = bucket_sizes(max_bs)
        self.max_bs = max_bs
        self.max_model_len = max_model_len
        self.device = device
        dev = device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.hidden = torch.zeros(max_bs, hidden_size, dtype=dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _metadata(self, b: int) -> AttentionMetadata:
        # max_seq_len = the context limit: the split-K count fixed at capture must cover any length
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], num_prefills=0,
            num_prefill_tokens=0, num_decode_tokens=b, max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=[1] * b,
            extras={"cuda_graph": True},
        )

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for b in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            with forward_context(self._metadata(b), self.kv_caches, self.backend, hooks=self.hooks):
                self.hidden[:b] = self.model(self.input_ids[:b], self.positions[:b])  # warm-up
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            # fresh metadata: what a step computes once and keeps in md.extras (the decode order) must
            # be computed inside the graph, not taken from the warm-up
            with forward_context(self._metadata(b), self.kv_caches, self.backend, hooks=self.hooks):
                with torch.cuda.graph(g, pool=pool):
                    self.hidden[:b] = self.model(self.input_ids[:b], self.positions[:b])
            pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode graphs (batch sizes %s)", len(self.graphs), self.sizes)

    def can_run(self, md: AttentionMetadata) -> bool:
        return (md.num_prefills == 0 and md.num_seqs <= self.max_bs
                and md.block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, ids: torch.Tensor, pos: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        B = md.num_seqs
        b = next(s for s in self.sizes if s >= B)
        nb = md.block_tables.shape[1]
        self.input_ids[:B].copy_(ids)
        self.positions[:B].copy_(pos)
        self.slot_mapping[:B].copy_(md.slot_mapping)
        self.seq_lens[:B].copy_(md.seq_lens)
        self.block_tables[:B, :nb].copy_(md.block_tables)
        if b > B:
            self.slot_mapping[B:b].fill_(-1)
            self.seq_lens[B:b].fill_(1)
            self.block_tables[B:b, 0].fill_(0)
        self.graphs[b].replay()
        return self.hidden[:B]
