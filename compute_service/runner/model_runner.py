"""ModelRunner: owns the model and the paged KV tensors; turns a SchedulerOutput into tensors.

It builds the step's AttentionMetadata (slot_mapping, block_tables, seq_lens, query_start_loc),
runs the model inside a forward context, and returns logits for the rows that sample.
"""

from __future__ import annotations

import gc
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nanokv.cache_service.kv.cache import LayerKVCache, bytes_per_block
from nanokv.cache_service.kv.resize import resize_layer_cache
from nanokv.cache_service.kv.rotation import rotation_matrix
from nanokv.cache_service.kv.staging import StageTable, staging_slots
from nanokv.cache_service.storage import carve_layer_caches, map_handle, pool_nbytes
from nanokv.compute_service.attention.backend import make_backend
from nanokv.compute_service.attention.metadata import AttentionMetadata, forward_context
from nanokv.compute_service.model.layers.fusion import set_fusion
from nanokv.compute_service.runner.cuda_graph import DecodeGraphs
from nanokv.compute_service.runner.h2d import PinnedUploader
from nanokv.config import DEFAULT_CPU_KV_BYTES, ConfigError, EngineConfig
from nanokv.messages import PoolHandle, PoolLayout

if TYPE_CHECKING:
    from nanokv.compute_service.model.llama import LlamaForCausalLM
    from nanokv.compute_service.sparsity.probe import AttentionProbe

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
                 dtype: torch.dtype, num_kv_heads_local: int | None = None,
                 attach_pool: Callable[[PoolLayout], PoolHandle] | None = None):
        """attach_pool(layout) -> handle: the cache service allocates the KV pool this runner uses
        (nanokv.compute_service.service); None: a pool of its own (tools, tensor-parallel ranks)."""
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
        # one table for all layers (nanokv.cache_service.kv.staging)
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
        self.kv_caches: list[LayerKVCache] = carve_layer_caches(self.pool_layout, map_handle(self.pool_handle),
                                                                self.stage)
        self.graphs: DecodeGraphs | None = None
        self._graph_model_len = 0  # max_model_len the graphs were captured for (re-capture after a resize)
        self.attn_probe: AttentionProbe | None = None  # sparsity: put into each step's metadata
        self.uploader = PinnedUploader(device)
        self.demotion_store: Any = None  # hybrid sparsity: nanokv.cache_service.kv.demote.DemotionStore over kv_caches

    @property
    def pool_epoch(self) -> int:
        """The epoch of the pool mapped now (0: none, the cache service went away)."""
        return self.pool_handle.epoch if self.pool_handle is not None and self.kv_caches else 0

    def release_pool(self) -> None:
        """Drop every view of the cache service's segment (it died, or is about to hand out a new
        one): the graphs captured on it and the layer caches. Steps fail until remap_pool."""
        self.graphs = None
        self.kv_caches = []
        self.pool_handle = None

    def remap_pool(self, attach_pool: Callable[[PoolLayout], PoolHandle], stage: StageTable | None = None) -> None:
        """Attach again (a restarted cache service) and carve the layers from the new segment. The
        model's weights already carry folded value rotations: the new caches are told so.
        stage: the staging table to use as is (a repool made it for its new layout)."""
        self.release_pool()
        handle = attach_pool(self.pool_layout)
        if stage is not None:
            self.stage = stage
        elif self.stage is not None:  # the staging slots' bookkeeping described the old segment
            old = self.stage
            self.stage = StageTable(self.num_blocks, self._stage_slots(), self.block_size, self.device)
            self.stage.block_free = old.block_free
        self.kv_caches = carve_layer_caches(self.pool_layout, map_handle(handle), self.stage)
        folded: set[int] = getattr(self, "_folded_layers", set())
        for i, cache in enumerate(self.kv_caches):
            if i in folded:
                cache.rotate_v_in_weights = True
        self.pool_handle = handle
        if self._graph_model_len:
            self.capture_cudagraphs(self._graph_model_len)

    def check_repool(self, num_blocks: int | None, layer_bits: list[int] | None) -> tuple[int, list[int]]:
        """The new layout's block count and widths, or a ConfigError naming the field (nothing changed).
        A layer may go to int4 only if its value rotation is already in the weights (it started as
        int4): folding again would rotate them twice."""
        bits = list(self.layer_bits if layer_bits is None else layer_bits)
        if len(bits) != self.num_layers or any(b not in (4, 8, 16) for b in bits):
            raise ConfigError("layer_bits", f"one width per layer ({self.num_layers} layers), each 4, 8 or 16")
        folded: set[int] = getattr(self, "_folded_layers", set())
        unfolded = [i for i, b in enumerate(bits) if b == 4 and i not in folded]
        if unfolded:
            raise ConfigError("layer_bits", f"layers {unfolded} did not start as int4 (their value rotation is "
                                            "not in the weights): allowed widths there are 8 or 16")
        n = self.num_blocks if num_blocks is None else int(num_blocks)
        if not 1 <= n <= 1 << 24:
            raise ConfigError("num_blocks", f"{n}: allowed 1..{1 << 24}")
        return n, bits

    def repool(self, attach_pool: Callable[[PoolLayout], PoolHandle], num_blocks: int | None = None,
               layer_bits: list[int] | None = None) -> None:
        """A pool change through the attach protocol: drop every view of the old segment, attach a
        pool of the new layout (the cache service allocates it under a new epoch), carve the layers
        and capture the decode graphs again. The contents do not move: the caller has taken every
        sequence back (they are recomputed)."""
        n, bits = self.check_repool(num_blocks, layer_bits)
        self.release_pool()
        gc.collect()  # the old segment's mapping (a CUDA IPC open, or an mmap) goes with its last view
        old = self.stage
        self.num_blocks, self.layer_bits = n, bits
        self.stage = None
        if 4 in bits:
            self.stage = StageTable(n, min(self._stage_slots(), n), self.block_size, self.device)
            if old is not None:
                self.stage.block_free = old.block_free
        lay = self.pool_layout
        self.pool_layout = PoolLayout(n, lay.block_size, lay.num_kv_heads, lay.head_dim, bits, lay.dtype,
                                      self.stage.num_slots if self.stage is not None else 0, lay.device)
        self.stage, stage = None, self.stage  # remap_pool rebuilds an existing table from the old layout
        self.remap_pool(attach_pool, stage)

    def fold_value_rotations(self) -> None:
        """For each layer whose format stores values rotated (int4), fold the rotation into the model's
        v and o projections (LlamaForCausalLM.fold_value_rotation), once per model. Only the engine
        that owns the model calls this (the eval harness runs several formats over one model and keeps
        the GEMMs): a folded layer's values are in the rotated basis for any
        format, which attention reads exactly."""
        fold = getattr(self.model, "fold_value_rotation", None)
        if fold is None:
            return
        for i, cache in enumerate(self.kv_caches):
            if cache.rotate_v:
                fold(i, rotation_matrix(self.head_dim, torch.float32, self.device))
                cache.rotate_v_in_weights = True
                self._folded_layers = getattr(self, "_folded_layers", set()) | {i}

    def capture_cudagraphs(self, max_model_len: int) -> None:
        """Capture decode graphs (CUDA only, unless enforce_eager)."""
        if self.device.type != "cuda" or self.cfg.enforce_eager:
            return
        self._graph_model_len = max_model_len
        if self.stage is not None and self.backend.name != "triton":
            # int4 quantizes the blocks a step fills after its attention; inside a graph that is the
            # Triton kernel of nanokv.kernels.triton_blockquant (blocks found on the device). The torch
            # attention path syncs on staged blocks: without Triton (or when asked), int4 decodes run eagerly
            log.info("int4 KV layers: decode CUDA graphs off")
            return
        max_bs = min(self.cfg.max_num_seqs, 512)
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, self.mc.hidden_size, max_bs,
                                   max_blocks, max_model_len, self.dtype, self.device)
        self.graphs.capture()

    def resize_kv(self, num_blocks: int) -> None:
        """Reallocate every layer's KV tensors to ``num_blocks`` blocks, keeping blocks
        [0, min(N, num_blocks)) (the cache manager resized first and removed only unreferenced
        blocks). The decode graphs captured the old tensors' addresses: they are dropped first (so
        their memory pool can go too) and captured again. After a shrink on CUDA the freed memory
        goes back to the device (empty_cache), which is the point of shrinking. Layers already at
        ``num_blocks`` are skipped, so calling it again after a failure (OOM) mid-way repairs it."""
        if all(c.num_blocks == num_blocks for c in self.kv_caches) and num_blocks == self.num_blocks:
            return
        self.graphs = None
        shrink = num_blocks < self.num_blocks
        for cache in self.kv_caches:
            if cache.num_blocks != num_blocks:
                resize_layer_cache(cache, num_blocks)
        if self.stage is not None:
            self.stage.resize(num_blocks)
        self.num_blocks = num_blocks
        if self.device.type == "cuda":
            if shrink:
                torch.cuda.empty_cache()
            if self._graph_model_len:  # graphs were captured at start-up
                self.capture_cudagraphs(self._graph_model_len)
        log.info("KV pool resized to %d blocks", num_blocks)

    # ---- sizing -------------------------------------------------------------------------------
    def bytes_per_block_all_layers(self) -> int:
        return sum(bytes_per_block(b, self.num_kv_heads, self.block_size, self.head_dim, self.dtype)
                   for b in self.layer_bits)

    def _stage_slots(self) -> int:
        """Staging slots for int4 layers: never more than there are blocks."""
        return min(staging_slots(self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens, self.block_size),
                   self.cfg.num_gpu_blocks or 1 << 62)

    def staging_bytes(self) -> int:
        """Full-precision staging of open int4 blocks, all layers (not part of the pool's bytes)."""
        if 4 not in self.layer_bits:
            return 0
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_slot = 2 * self.num_kv_heads * self.block_size * self.head_dim * elem
        return self._stage_slots() * per_slot * self.layer_bits.count(4)

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
        budget -= self.staging_bytes()
        n = budget // per_block
        if n < 1:
            raise RuntimeError(f"not enough memory for even one KV block ({per_block} bytes per block)")
        return int(n)

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
                feed: tuple[torch.Tensor, list[int], list[int]] | None = None) -> torch.Tensor | None:
        """Run one step. Returns float32 logits for the last token of each row in `logits_rows`
        ([len(rows), V]) or, with all_logits, for every query token ([T, V]).

        feed (async scheduling): (tokens [n] on the device, src rows, dst token offsets): input
        token dst[i] is tokens[src[i]], sampled by the previous step and not yet seen by the host."""
        fed = feed is not None and bool(feed[1])
        extra = [np.asarray(feed[2], dtype=np.int64), np.asarray(feed[1], dtype=np.int64)] \
            if feed is not None and fed else []
        rows = logits_rows if logits_rows is not None else list(range(len(items)))
        ids, pos, md, extra_t = self.build_metadata(items, extra, None if all_logits else rows)
        if feed is not None and fed:
            dst_t, src_t = extra_t
            ids.index_copy_(0, dst_t, feed[0].index_select(0, src_t))
        try:
            return self._run(ids, pos, md, rows, all_logits)
        finally:
            if self.stage is not None:  # blocks filled by this step are quantized: free their staging
                self.stage.finish(defer=True)  # (the device map changes with the next step's copy)

    def _run(self, ids, pos, md, rows, all_logits) -> torch.Tensor | None:
        with forward_context(md, self.kv_caches, self.backend, self.batch_invariant):
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
