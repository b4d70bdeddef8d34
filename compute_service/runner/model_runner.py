"""ModelRunner: owns the model and the paged KV tensors; turns a SchedulerOutput into tensors.

It builds the step's AttentionMetadata (slot_mapping, block_tables, seq_lens, query_start_loc),
runs the model inside a forward context, and returns logits for the rows that sample. The pool's
sizing, attachment, resizing and decode graphs are its KVPool base (nanokv.compute_service.runner.kv_pool).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nanokv.compute_service.attention.backend import make_backend
from nanokv.compute_service.distributed import broadcast_from_rank0
from nanokv.compute_service.kv_hooks import LayerHooks
from nanokv.compute_service.model.layers.fusion import set_fusion
from nanokv.compute_service.runner.cuda_graph import DecodeGraphs
from nanokv.compute_service.runner.h2d import PinnedUploader
from nanokv.compute_service.runner.kv_pool import KVPool
from nanokv.config import ComputeConfig, ConfigError
from nanokv.kv.cache import LayerKV
from nanokv.kv.metadata import AttentionMetadata, forward_context
from nanokv.kv.segment import carve_layer_caches, map_handle, pool_nbytes
from nanokv.kv.staging import StageTable
from nanokv.messages import PoolHandle, PoolLayout

if TYPE_CHECKING:
    from nanokv.compute_service.model.llama import LlamaForCausalLM
    from nanokv.compute_service.sparsity.probe import AttentionProbe


def resolve_device(cfg: ComputeConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def resolve_dtype(cfg: ComputeConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


class ModelRunner(KVPool):
    def __init__(self, cfg: ComputeConfig, model: LlamaForCausalLM, model_config, device: torch.device,
                 dtype: torch.dtype, num_kv_heads_local: int | None = None,
                 attach_pool: Callable[[PoolLayout], PoolHandle] | None = None,
                 free_segment: Callable[[int], None] | None = None):
        """attach_pool(layout) -> handle: the cache service allocates the KV pool this runner uses
        (nanokv.compute_service.service); None: a pool of its own (tools, tensor-parallel ranks).
        free_segment(epoch): the in-process cache service frees the segment once an in-place resize or
        re-format has moved every layer out of it (KVPool._moved_out)."""
        self.cfg = cfg
        self.model: Any = model  # a nanokv model: forward(ids, positions) and compute_logits(hidden)
        self.mc = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = cfg.block_size
        self.num_layers = model_config.num_hidden_layers
        self.num_kv_heads = num_kv_heads_local or model_config.num_key_value_heads
        self.head_dim = model_config.head_dim
        self.layer_bits = cfg.layer_bits(self.num_layers)
        torch_cpu = device.type == "cpu" and cfg.attention_backend != "triton"
        if cfg.batch_invariant and not torch_cpu:
            raise ConfigError("batch_invariant", "CPU with the torch attention backend only (the GPU kernels "
                                                 "are not batch-invariant); set it false or null (auto)")
        self.batch_invariant = torch_cpu and (cfg.batch_invariant if cfg.batch_invariant is not None
                                              else cfg.enable_compression)
        from nanokv.kernels.triton_config import set_overrides  # stdlib only: no Triton import here

        try:
            set_overrides(cfg.kernel_options)
        except ValueError as e:
            raise ConfigError("kernel_options", str(e)) from None
        self.backend = make_backend(cfg.attention_backend, device, batch_invariant=self.batch_invariant)
        # fused elementwise chains (Triton kernels, or torch.compile) ride with the CUDA graphs: off in eager mode
        set_fusion(device.type == "cuda" and not cfg.enforce_eager)
        self.num_blocks = self._decide_num_blocks()
        # int4 layers quantize a block once it fills; open blocks wait in full-precision staging,
        # one table for all layers (nanokv.kv.staging)
        self.stage: StageTable | None = None
        if 4 in self.layer_bits:
            self.stage = StageTable(self.num_blocks, self._stage_slots(), self.block_size, device)
        self.pool_handle: PoolHandle | None
        self.pool_layout = PoolLayout(
            self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim, list(self.layer_bits),
            str(dtype).removeprefix("torch."), self.stage.num_slots if self.stage is not None else 0, str(device))
        if attach_pool is None:
            self.pool_handle = PoolHandle("local", pool_nbytes(self.pool_layout), 0,
                                          buffer=torch.zeros(pool_nbytes(self.pool_layout), dtype=torch.uint8,
                                                             device=device))
        else:
            self.pool_handle = attach_pool(self.pool_layout)
        # every layer's K/V (codes, scales, int4 staging): views of the one segment the cache service owns
        self.kv_caches: list[LayerKV] = carve_layer_caches(self.pool_layout, map_handle(self.pool_handle),
                                                           self.stage)
        # each layer's run-time hooks (monitor, error probe, folded value rotation): they outlive the
        # KV objects above, which a resize, re-format or re-attach replaces
        self.layer_hooks = [LayerHooks() for _ in range(self.num_layers)]
        self.in_segment, self.segment_epoch = set(range(self.num_layers)), self.pool_handle.epoch
        self.free_segment = free_segment
        self.graphs: DecodeGraphs | None = None
        self._graph_model_len = 0  # max_model_len the graphs were captured for (re-capture after a resize)
        self.attn_probe: AttentionProbe | None = None  # sparsity: put into each step's metadata
        self.uploader = PinnedUploader(device)
        self.demotion_store: Any = None  # hybrid sparsity: nanokv.kv.demote.DemotionStore over kv_caches

    # ---- one step -----------------------------------------------------------------------------
    def build_metadata(self, items, extra: list[np.ndarray] | None = None, logits_rows: list[int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[torch.Tensor]]:
        """items: list of (token_ids, num_computed, num_new, block_table, is_prefill), prefills first.

        Returns input_ids [T], positions [T], metadata, and `extra` host arrays on the device: all
        of them sent in one copy (nanokv.compute_service.runner.h2d). Host work is numpy, one pass per sequence.
        logits_rows: rows to sample; unless they are every token of the step (decode only), the
        packed index of each one's last token goes in the same copy, as md.extras["logits_index"].
        (Built on the host after the forward, torch.tensor(..., device=), that pageable copy waited
        for the whole forward and left the GPU idle through the host's next step: 0.17-0.28 s of
        a long-context run's prefills, H200.)
        """
        bs = self.block_size
        B = len(items)
        starts = np.fromiter((it[1] for it in items), dtype=np.int64, count=B)
        lens = np.fromiter((it[2] for it in items), dtype=np.int64, count=B)
        ends = starts + lens
        max_blocks = int((ends.max() + bs - 1) // bs)
        tables = np.full((B, max_blocks), -1, dtype=np.int32)
        # block tables scattered in one numpy assignment (row by row costs ~3 us a row at batch 256)
        nbs = np.fromiter((min(len(it[3]), max_blocks) for it in items), dtype=np.int64, count=B)
        flat = np.fromiter(itertools.chain.from_iterable(
            it[3] if len(it[3]) <= max_blocks else it[3][:max_blocks] for it in items), dtype=np.int32)
        row_of = np.repeat(np.arange(B), nbs)
        tables[row_of, np.arange(len(flat)) - np.repeat(np.cumsum(nbs) - nbs, nbs)] = flat
        input_ids: list[int] = []
        for token_ids, start, n, _, _ in items:
            if n == 1:
                input_ids.append(token_ids[start])
            else:
                input_ids.extend(token_ids[start:start + n])
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        T = int(qsl[-1])
        row = np.repeat(np.arange(B), lens)  # [T] sequence of each token
        positions = np.arange(T, dtype=np.int64) - qsl[:-1][row] + starts[row]
        blk = tables[row, positions // bs].astype(np.int64)
        slots = np.where(blk >= 0, blk * bs + positions % bs, -1)
        last: list[np.ndarray] = []
        if logits_rows and not len(logits_rows) == B == T:
            last = [qsl[1:][np.asarray(logits_rows, dtype=np.int64)] - 1]
        num_prefills = sum(1 for it in items if it[4])
        num_prefill_tokens = int(lens[:num_prefills].sum())
        qsl_list = qsl.tolist()
        seq_lens = ends.tolist()
        stage_upd: list[np.ndarray] = []
        fills: list[np.ndarray] = []
        if self.stage is not None:  # int4: staging slots for every block this step writes
            self.stage.plan(slots, defer=True)
            stage_upd = self.stage.pending()  # its device-map updates travel in the same copy
            if num_prefills:  # eager step: the fill kernel gets only the filled blocks' last slots
                fills = [self.stage.last_slots()]
        ids, pos, slot_t, qsl_t, lens_t, tables_t, *extra_t = self.uploader.upload(
            [np.asarray(input_ids, dtype=np.int64), positions, slots, qsl.astype(np.int32),
             ends.astype(np.int32), tables, *(extra or []), *last, *fills, *stage_upd])
        if self.stage is not None:
            self.stage.apply(*extra_t[-3:])
            extra_t = extra_t[:-3]
        fill_t = extra_t.pop() if fills else None
        last_t = extra_t.pop() if last else None
        md = AttentionMetadata(
            slot_mapping=slot_t,
            query_start_loc=qsl_t,
            seq_lens=lens_t,
            block_tables=tables_t,
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=T - num_prefill_tokens,
            max_query_len=int(lens.max()),
            max_seq_len=int(ends.max()),
            query_start_loc_cpu=qsl_list,
            seq_lens_cpu=seq_lens,
        )
        if last_t is not None:
            md.extras["logits_index"] = last_t
        if fill_t is not None:  # (read by nanokv.compute_service.kv_hooks.after_attention)
            md.extras["fill_slots"] = fill_t
        if self.attn_probe is not None:  # read by nanokv.compute_service.kv_hooks.before_store in every layer
            md.extras["attn_probe"] = self.attn_probe.begin(md)
        return ids, pos, md, extra_t

    @torch.inference_mode()
    def execute(self, items, logits_rows: list[int] | None = None, all_logits: bool = False,
                feed: tuple[torch.Tensor, list[int], list[int]] | None = None,
                ids_from_rank0: bool = False) -> torch.Tensor | None:
        """Run one step. Returns float32 logits for the last token of each row in `logits_rows`
        ([len(rows), V]) or, with all_logits, for every query token ([T, V]).

        feed (async scheduling): (tokens [n] on the device, src rows, dst token offsets): input
        token dst[i] is tokens[src[i]], sampled by the previous step and not yet seen by the host.
        ids_from_rank0: every tensor-parallel rank takes rank 0's input ids [T], after rank 0's feed
        (only rank 0 has the previous step's samples); a collective, so all ranks pass it together."""
        fed = feed is not None and bool(feed[1])
        extra = [np.asarray(feed[2], dtype=np.int64), np.asarray(feed[1], dtype=np.int64)] \
            if feed is not None and fed else []
        rows = logits_rows if logits_rows is not None else list(range(len(items)))
        ids, pos, md, extra_t = self.build_metadata(items, extra, None if all_logits else rows)
        if feed is not None and fed:
            dst_t, src_t = extra_t
            ids.index_copy_(0, dst_t, feed[0].index_select(0, src_t))
        if ids_from_rank0:
            broadcast_from_rank0(ids)  # (the data group: NCCL on CUDA, stream-ordered after the copy)
        try:
            return self._run(ids, pos, md, rows, all_logits)
        finally:
            if self.stage is not None:  # blocks filled by this step are quantized: free their staging
                self.stage.finish(defer=True)  # (the device map changes with the next step's copy)

    def _run(self, ids, pos, md, rows, all_logits) -> torch.Tensor | None:
        with forward_context(md, self.kv_caches, self.backend, self.batch_invariant, self.layer_hooks):
            if self.graphs is not None and not all_logits and self.graphs.can_run(md):
                hidden = self.graphs.run(ids, pos, md)
            else:
                hidden = self.model(ids, pos)
            if all_logits:
                return self.model.compute_logits(hidden)
            if not rows:
                return None
            # sampling logits stay in the model's dtype on a GPU (a [B, 151936] float32 copy costs
            # more than the argmax; the sampler upcasts where it needs to): float32 on the CPU path
            f32 = self.device.type != "cuda"
            last = md.extras.get("logits_index")  # (absent: decode only, every row is its last token)
            return self.model.compute_logits(hidden if last is None else hidden[last], f32)
