"""KV storage: the pool's tensors, every layer and format, carved from one flat byte segment.

The cache service allocates the segment; the compute service maps the same bytes once when it
attaches and carves the same views from them (carve_layer_caches, run by both sides with the same
layout, gives identical tensors: same order, same offsets). So no KV byte crosses an RPC: only the
handle does (nanokv.messages.PoolHandle).

  local  same process (the in-process transport): the handle carries the tensor itself
  shm    a file in /dev/shm (or the temp dir) of `nbytes`, mapped shared by both processes
         (torch.from_file(shared=True) is mmap MAP_SHARED); the cache service creates and removes it
  cuda_ipc  a device allocation of the cache service's, exported over CUDA IPC
         (nanokv.cache_service.cuda_ipc); the compute service opens it once

The only module of the cache service that imports torch.
"""

from __future__ import annotations

import dataclasses
import os
import weakref

import torch

from nanokv.cache_service.segments import new_segment_path
from nanokv.kv.cache import LayerKVCache, allocate_layer_cache
from nanokv.kv.staging import StageTable
from nanokv.messages import PoolHandle, PoolLayout

_ALIGN = 256  # bytes: every carved tensor starts aligned (vector loads, any element size)


class Carver:
    """alloc(shape, dtype) for allocate_layer_cache: consecutive aligned views of `buffer` ([n] uint8),
    or, with no buffer, meta tensors that only count the bytes (pool_nbytes)."""

    def __init__(self, buffer: torch.Tensor | None = None):
        self.buffer = buffer
        self.offset = 0

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        start = -(-self.offset // _ALIGN) * _ALIGN
        self.offset = start + nbytes
        if self.buffer is None:
            return torch.empty(shape, dtype=dtype, device="meta")
        if self.offset > self.buffer.numel():
            raise RuntimeError(f"KV segment too small: {self.buffer.numel()} bytes, layout needs {self.offset}")
        return self.buffer[start:start + nbytes].view(dtype).view(shape)


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def carve_layer_caches(layout: PoolLayout, buffer: torch.Tensor | None,
                       stage: StageTable | None = None) -> list[LayerKVCache]:
    """Every layer's LayerKVCache as views of `buffer`, in layer order (None: meta tensors)."""
    carver = Carver(buffer)
    device = buffer.device if buffer is not None else torch.device("meta")
    if stage is None and 4 in layout.layer_bits:
        stage = StageTable(layout.num_blocks, max(layout.stage_slots, 1), layout.block_size, "cpu")
    dtype = torch_dtype(layout.dtype)
    return [allocate_layer_cache(b, layout.num_blocks, layout.num_kv_heads, layout.block_size, layout.head_dim,
                                 dtype, device, stage=stage, alloc=carver)
            for b in layout.layer_bits]


def pool_nbytes(layout: PoolLayout) -> int:
    carver = Carver(None)
    dtype = torch_dtype(layout.dtype)
    stage = StageTable(1, 1, layout.block_size, "cpu") if 4 in layout.layer_bits else None
    if stage is not None:
        stage.num_slots = max(layout.stage_slots, 1)  # only its slot count shapes the staging tensors
    for b in layout.layer_bits:
        allocate_layer_cache(b, layout.num_blocks, layout.num_kv_heads, layout.block_size, layout.head_dim,
                             dtype, "meta", stage=stage, alloc=carver)
    return -(-carver.offset // _ALIGN) * _ALIGN


def rank_layouts(layout: PoolLayout) -> list[PoolLayout]:
    """Tensor parallelism: the layouts of ranks 1..N-1's pools (rank 0's is `layout` itself): the
    same blocks and widths over each rank's own KV heads, on its own device."""
    if len(layout.rank_kv_heads) != len(layout.rank_devices):
        raise ValueError("rank_kv_heads and rank_devices: one entry per rank after rank 0")
    return [dataclasses.replace(layout, num_kv_heads=heads, device=device, rank_kv_heads=[], rank_devices=[])
            for heads, device in zip(layout.rank_kv_heads, layout.rank_devices)]


class PoolStorage:
    """The segment the cache service owns: allocated on attach, removed on close. Under tensor
    parallelism it also owns one segment per further rank (`ranks`), always shareable: those ranks
    are other processes even when the cache service runs in rank 0's."""

    def __init__(self, layout: PoolLayout, shared: bool, epoch: int):
        self.layout = layout
        self.ranks = [PoolStorage(r, True, epoch) for r in rank_layouts(layout)]
        self.nbytes = pool_nbytes(layout)
        self.epoch = epoch
        self.path = ""
        self.cuda_ipc = shared and torch.device(layout.device).type == "cuda"
        if self.cuda_ipc:
            from nanokv.cache_service.cuda_ipc import allocate_exportable

            self.buffer = allocate_exportable(self.nbytes, torch.device(layout.device))
        elif layout.device != "cpu" or not shared:
            self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=layout.device)
        else:
            self.path = new_segment_path()  # the owner's pid in the name: cache_service/segments.py
            with open(self.path, "wb") as f:
                f.truncate(self.nbytes)  # a sparse file of zeros: pages appear as they are written
            self.buffer = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)
            # the file goes with this object too (an in-process cache service is never closed) and at exit
            self._unlink = weakref.finalize(self, _unlink, self.path)

    def reusable_for(self, layout: PoolLayout) -> bool:
        """A device segment is handed out again to a new attach of the same layout (a restarted
        compute service): a consumer that died without dropping its mapping never gives its IPC
        reference back, so PyTorch would keep a freed segment forever, and a new one would not fit."""
        return self.cuda_ipc and layout == self.layout

    def handle(self) -> PoolHandle:
        # every rank's pool is of rank 0's epoch (a reused segment gets a new one on rank 0's storage only)
        ranks = [dataclasses.replace(r.handle(), epoch=self.epoch) for r in self.ranks]
        if self.cuda_ipc:
            from nanokv.cache_service.cuda_ipc import export

            return PoolHandle("cuda_ipc", self.nbytes, self.epoch, cuda=export(self.buffer), ranks=ranks)
        if self.path:
            return PoolHandle("shm", self.nbytes, self.epoch, path=self.path, ranks=ranks)
        return PoolHandle("local", self.nbytes, self.epoch, buffer=self.buffer, ranks=ranks)

    def close(self) -> None:
        """Remove the file; mappings already made stay valid until their owners drop them."""
        for r in self.ranks:
            r.close()
        if self.path:
            self._unlink()
            self.path = ""


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def map_handle(handle: PoolHandle) -> torch.Tensor:
    """The compute service's view of the segment: [nbytes] uint8."""
    if handle.kind == "local":
        if not isinstance(handle.buffer, torch.Tensor):
            raise ValueError("a local pool handle carries its tensor")
        return handle.buffer
    if handle.kind == "cuda_ipc":
        from nanokv.cache_service.cuda_ipc import open_handle

        if handle.cuda is None:
            raise ValueError("a cuda_ipc pool handle carries its CUDA IPC export")
        return open_handle(handle.cuda, handle.nbytes)
    if handle.kind == "shm":
        if not os.path.exists(handle.path):
            raise FileNotFoundError(f"KV segment {handle.path} is gone (cache service restarted?)")
        return torch.from_file(handle.path, shared=True, size=handle.nbytes, dtype=torch.uint8)
    raise ValueError(f"unknown pool handle kind {handle.kind!r}")
