"""ModelRunner: owns the model and the paged KV tensors; turns a SchedulerOutput into tensors.

It builds the step's AttentionMetadata (slot_mapping, block_tables, seq_lens, query_start_loc),
runs the model inside a forward context, and returns logits for the rows that sample.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanokv.attention.backend import set_backend
from nanokv.attention.metadata import AttentionMetadata, forward_context
from nanokv.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from nanokv.kv.cache import LayerKVCache, allocate_layer_cache, bytes_per_block
from nanokv.runner.cuda_graph import DecodeGraphs

if TYPE_CHECKING:
    from nanokv.model.llama import LlamaForCausalLM
    from nanokv.sparsity.probe import AttentionProbe

log = logging.getLogger(__name__)


def resolve_device(cfg: EngineConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def resolve_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model: LlamaForCausalLM, model_config, device: torch.device,
                 dtype: torch.dtype, num_kv_heads_local: int | None = None):
        self.cfg = cfg
        self.model = model
        self.mc = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = cfg.block_size
        self.num_layers = model_config.num_hidden_layers
        self.num_kv_heads = num_kv_heads_local or model_config.num_key_value_heads
        self.head_dim = model_config.head_dim
        self.layer_bits = cfg.layer_bits(self.num_layers)
        self.backend = set_backend(cfg.attention_backend, device)
        self.num_blocks = self._decide_num_blocks()
        self.kv_caches: list[LayerKVCache] = [
            allocate_layer_cache(b, self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim,
                                 dtype, device)
            for b in self.layer_bits
        ]
        self.graphs: DecodeGraphs | None = None
        self.attn_probe: AttentionProbe | None = None  # sparsity: put into each step's metadata

    def capture_cudagraphs(self, max_model_len: int) -> None:
        """Capture decode graphs (CUDA only, unless enforce_eager)."""
        if self.device.type != "cuda" or self.cfg.enforce_eager:
            return
        max_bs = min(self.cfg.max_num_seqs, 512)
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.mc.hidden_size, max_bs, max_blocks,
                                   max_model_len, self.dtype, self.device)
        self.graphs.capture()

    # ---- sizing -------------------------------------------------------------------------------
    def bytes_per_block_all_layers(self) -> int:
        return sum(bytes_per_block(b, self.num_kv_heads, self.block_size, self.head_dim, self.dtype)
                   for b in self.layer_bits)

    def _decide_num_blocks(self) -> int:
        if self.cfg.num_gpu_blocks is not None:
            return self.cfg.num_gpu_blocks
        per_block = self.bytes_per_block_all_layers()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            # leave room for activations of the largest step: a rough upper bound per token
            act = self.cfg.max_num_batched_tokens * self.mc.hidden_size * 4 * 16 + (1 << 30)
            budget = int(total * self.cfg.gpu_memory_utilization) - used_by_others - act
        else:
            budget = self.cfg.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
        n = budget // per_block
        if n < 1:
            raise RuntimeError(f"not enough memory for even one KV block ({per_block} bytes per block)")
        return int(n)

    # ---- one step -----------------------------------------------------------------------------
    def build_metadata(self, items) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """items: list of (token_ids, num_computed, num_new, block_table, is_prefill), prefills first.

        Returns input_ids [T], positions [T], metadata. Host work is numpy, one pass per sequence.
        """
        bs = self.block_size
        B = len(items)
        starts = np.fromiter((it[1] for it in items), dtype=np.int64, count=B)
        lens = np.fromiter((it[2] for it in items), dtype=np.int64, count=B)
        ends = starts + lens
        max_blocks = int((ends.max() + bs - 1) // bs)
        tables = np.full((B, max_blocks), -1, dtype=np.int32)
        input_ids: list[int] = []
        for r, (token_ids, start, n, table, _) in enumerate(items):
            nb = min(len(table), max_blocks)
            tables[r, :nb] = table[:nb]
            input_ids.extend(token_ids[start:start + n])
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        T = int(qsl[-1])
        row = np.repeat(np.arange(B), lens)  # [T] sequence of each token
        positions = np.arange(T, dtype=np.int64) - qsl[:-1][row] + starts[row]
        blk = tables[row, positions // bs].astype(np.int64)
        slots = np.where(blk >= 0, blk * bs + positions % bs, -1)
        num_prefills = sum(1 for it in items if it[4])
        num_prefill_tokens = int(lens[:num_prefills].sum())
        dev = self.device
        qsl_list = qsl.tolist()
        seq_lens = ends.tolist()
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(ends.astype(np.int32)).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(tables).to(dev, non_blocking=True),
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=T - num_prefill_tokens,
            max_query_len=int(lens.max()),
            max_seq_len=int(ends.max()),
            query_start_loc_cpu=qsl_list,
            seq_lens_cpu=seq_lens,
        )
        if self.attn_probe is not None:  # read by nanokv.kv.hooks.before_store in every layer
            md.extras["attn_probe"] = self.attn_probe.begin(md)
        ids = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True)
        pos = torch.from_numpy(positions).to(dev, non_blocking=True)
        return ids, pos, md

    @torch.inference_mode()
    def execute(self, items, logits_rows: list[int] | None = None,
                all_logits: bool = False) -> torch.Tensor | None:
        """Run one step. Returns float32 logits for the last token of each row in `logits_rows`
        ([len(rows), V]) or, with all_logits, for every query token ([T, V])."""
        ids, pos, md = self.build_metadata(items)
        with forward_context(md, self.kv_caches):
            if self.graphs is not None and not all_logits and self.graphs.can_run(md):
                hidden = self.graphs.run(ids, pos, md)
            else:
                hidden = self.model(ids, pos)
            if all_logits:
                return self.model.compute_logits(hidden)
            rows = logits_rows if logits_rows is not None else list(range(len(items)))
            if not rows:
                return None
            idx = torch.tensor([md.query_start_loc_cpu[r + 1] - 1 for r in rows], device=self.device)
            return self.model.compute_logits(hidden[idx])
