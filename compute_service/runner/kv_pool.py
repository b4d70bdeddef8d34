"""The KV pool side of ModelRunner: how many blocks it gets, its attachment to the cache service's
segment (attach, release, remap, repool), resizing in place, and the decode CUDA graphs, which
captured the pool's addresses and so are captured again after every change of it.

A mixin: ModelRunner (nanokv.compute_service.runner.model_runner) sets every attribute declared
below in its __init__, and callers keep reaching these methods on the runner.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from nanokv.compute_service.attention.backend import AttentionBackend
from nanokv.compute_service.kv_hooks import LayerHooks
from nanokv.compute_service.runner.cuda_graph import DecodeGraphs
from nanokv.compute_service.runner.kv_reformat import reformat_layer
from nanokv.compute_service.runner.kv_resize import resize_layer_cache
from nanokv.config import DEFAULT_CPU_KV_BYTES, ComputeConfig, ConfigError
from nanokv.kv.cache import Int4KV, LayerKV, bytes_per_block
from nanokv.kv.rotation import rotation_matrix
from nanokv.kv.segment import carve_layer_caches, map_handle, pool_nbytes
from nanokv.kv.staging import StageTable, staging_slots
from nanokv.messages import PoolHandle, PoolLayout

log = logging.getLogger(__name__)


class RankPools:
    """attach_pool for tensor-parallel ranks 1..N-1: the pools the cache service allocated with rank
    0's (PoolHandle.ranks, in rank order), sent to them by rank 0. Each rank takes its own and checks
    that it is the size its own layout needs (a mismatch would carve views past the segment)."""

    def __init__(self, handles: list[PoolHandle]):
        self.handles = handles

    def __call__(self, layout: PoolLayout) -> PoolHandle:
        from nanokv.compute_service.distributed import get_tp_rank

        rank = get_tp_rank()
        if not 1 <= rank <= len(self.handles):
            raise RuntimeError(f"tensor-parallel rank {rank}: the cache service exported {len(self.handles)} "
                               "pools for ranks after rank 0")
        handle = self.handles[rank - 1]
        need = pool_nbytes(layout)
        if handle.nbytes != need:
            raise RuntimeError(f"tensor-parallel rank {rank}: its KV layout needs {need} bytes, the cache "
                               f"service's pool for it has {handle.nbytes}")
        return handle


class KVPool:
    cfg: ComputeConfig
    model: Any
    mc: Any
    device: torch.device
    dtype: torch.dtype
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_bits: list[int]
    backend: AttentionBackend
    num_blocks: int
    stage: StageTable | None
    pool_handle: PoolHandle | None
    pool_layout: PoolLayout
    kv_caches: list[LayerKV]
    layer_hooks: list[LayerHooks]  # one per layer, for the runner's life (kv_caches' entries are replaced)
    graphs: DecodeGraphs | None
    _graph_model_len: int
    # layers whose tensors are still views of the attached segment, and that segment's epoch (None: no
    # layer views it any more). An in-place resize or re-format moves layers into tensors of their own;
    # once none is left the segment's memory can go (free_segment: the cache service's call, in process)
    in_segment: set[int]
    segment_epoch: int | None
    free_segment: Callable[[int], None] | None

    @property
    def pool_epoch(self) -> int:
        """The epoch of the pool mapped now (0: none, the cache service went away)."""
        return self.pool_handle.epoch if self.pool_handle is not None and self.kv_caches else 0

    def release_pool(self, collect: bool = False) -> None:
        """Drop every view of the cache service's segment (it died, or is about to hand out a new
        one): the graphs captured on it and the layer caches. Steps fail until remap_pool.
        collect: and let the mapping go now (a CUDA IPC open or an mmap goes with its last view)."""
        self.graphs = None
        self.kv_caches = []
        self.pool_handle = None
        if collect:
            gc.collect()

    def remap_pool(self, attach_pool: Callable[[PoolLayout], PoolHandle], stage: StageTable | None = None) -> None:
        """Attach again (a restarted cache service) and carve the layers from the new segment. The
        model's weights already carry folded value rotations: the layers' hooks, which stay, say so.
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
        self.in_segment, self.segment_epoch = set(range(len(self.kv_caches))), handle.epoch
        self.pool_handle = handle
        if self._graph_model_len:
            self.capture_cudagraphs(self._graph_model_len)

    def check_repool(self, num_blocks: int | None, layer_bits: list[int] | None) -> tuple[int, list[int]]:
        """The new layout's block count and widths, or a ConfigError naming the field (nothing changed).
        Any layer may become int4: one whose value rotation is in the weights (it started as int4 on
        a runner that folds) stays in that basis at every width, any other rotates its values in the
        hooks (nanokv.compute_service.kv_hooks), as tensor-parallel ranks always do."""
        bits = list(self.layer_bits if layer_bits is None else layer_bits)
        if len(bits) != self.num_layers or any(b not in (4, 8, 16) for b in bits):
            raise ConfigError("layer_bits", f"one width per layer ({self.num_layers} layers), each 4, 8 or 16")
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
        self.release_pool(collect=True)  # before the new pool is allocated: the old one's memory goes first
        old = self.stage
        self.num_blocks, self.layer_bits = n, bits
        stage = None
        if 4 in bits:
            stage = StageTable(n, min(self._stage_slots(), n), self.block_size, self.device)
            if old is not None:
                stage.block_free = old.block_free
        self.pool_layout = self.layout_for(n, bits)
        self.stage = None  # remap_pool rebuilds an existing table from the old layout; this one is new
        self.remap_pool(attach_pool, stage)

    def layout_for(self, num_blocks: int, layer_bits: list[int]) -> PoolLayout:
        """The layout of a pool of `num_blocks` blocks at these widths over this runner's KV heads."""
        lay = self.pool_layout
        slots = min(self._stage_slots(), num_blocks) if 4 in layer_bits else 0
        return PoolLayout(num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim, list(layer_bits), lay.dtype,
                          slots, lay.device)

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
            if cache.rotate_v and not self.layer_hooks[i].rotate_v_in_weights:
                fold(i, rotation_matrix(self.head_dim, torch.float32, self.device))
                self.layer_hooks[i].rotate_v_in_weights = True

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
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.layer_hooks, self.backend, self.mc.hidden_size,
                                   max_bs, max_blocks, max_model_len, self.dtype, self.device)
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
        for i, cache in enumerate(self.kv_caches):  # (entries replaced in place: graphs and stores read the list)
            if cache.num_blocks != num_blocks:
                cache = self.kv_caches[i] = resize_layer_cache(cache, num_blocks)
            if isinstance(cache, Int4KV):  # int4 staging: out of the segment too
                self.kv_caches[i] = dataclasses.replace(cache, k_stage=cache.k_stage.clone(),
                                                        v_stage=cache.v_stage.clone())
        if self.stage is not None:
            self.stage.resize(num_blocks)
        self.num_blocks = num_blocks
        self._moved_out(range(len(self.kv_caches)))
        if self.device.type == "cuda":
            if shrink:
                torch.cuda.empty_cache()
            if self._graph_model_len:  # graphs were captured at start-up
                self.capture_cudagraphs(self._graph_model_len)
        log.info("KV pool resized to %d blocks", num_blocks)

    def reformat_kv(self, changes: dict[int, int]) -> None:
        """Re-format layers in place to new widths ({layer: bits}; the adaptive KV-width rule,
        nanokv.compute_service.adaptive.precision), block ids and cached contents kept
        (nanokv.compute_service.runner.kv_reformat). The decode graphs captured the old tensors' addresses:
        they are dropped first and captured again once, after every layer has changed."""
        if not changes:
            return
        self.graphs = None
        for layer, bits in changes.items():
            self.kv_caches[layer] = reformat_layer(self.kv_caches[layer], bits, self.dtype, stage=self.stage,
                                                   values_in_weights=self.layer_hooks[layer].rotate_v_in_weights)
            self.layer_bits[layer] = bits
        self._moved_out(changes)
        if self._graph_model_len:
            self.capture_cudagraphs(self._graph_model_len)

    def _moved_out(self, layers: Iterable[int]) -> None:
        """These layers' tensors are no longer views of the segment (an in-place change). The layout
        follows what the runner now holds (a later re-attach asks for it); once no layer views the
        segment, drop the handle's reference to it and, in process, have the cache service free it:
        until then the whole segment stays allocated (a partial re-format keeps it)."""
        self.in_segment.difference_update(layers)
        self.pool_layout = self.layout_for(self.num_blocks, self.layer_bits)
        if self.in_segment or self.segment_epoch is None:
            return
        epoch, self.segment_epoch = self.segment_epoch, None
        if self.pool_handle is not None:
            self.pool_handle = dataclasses.replace(self.pool_handle, buffer=None)
        if self.free_segment is not None:
            self.free_segment(epoch)
        log.info("KV layers no longer view the segment of epoch %d: it is freed", epoch)

    def sync_ranks(self) -> None:
        """Tensor parallelism: return once every rank is here (run through call_all after an in-place
        change, before the cache service frees the segments the ranks copied from)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()

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
