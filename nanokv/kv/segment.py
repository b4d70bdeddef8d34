"""A KV pool segment's layout: every layer's tensors, every format, carved from one flat byte buffer.

The cache service allocates the segment (nanokv.cache_service.storage); the compute service maps the
same bytes once when it attaches (map_handle) and carves the same views from them: carve_layer_caches,
run by both sides with the same PoolLayout, gives identical tensors (same order, same offsets). So no
KV byte crosses an RPC: only the handle does (nanokv.messages.PoolHandle).
"""

from __future__ import annotations

import os

import torch

from nanokv.kv.cache import LayerKV, allocate_layer_cache
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
                       stage: StageTable | None = None) -> list[LayerKV]:
    """Every layer's KV (nanokv.kv.cache) as views of `buffer`, in layer order (None: meta tensors)."""
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


def map_handle(handle: PoolHandle) -> torch.Tensor:
    """The compute service's view of the segment: [nbytes] uint8."""
    if handle.kind == "local":
        if not isinstance(handle.buffer, torch.Tensor):
            raise ValueError("a local pool handle carries its tensor")
        return handle.buffer
    if handle.kind == "cuda_ipc":
        from nanokv.kv.cuda_ipc import open_handle

        if handle.cuda is None:
            raise ValueError("a cuda_ipc pool handle carries its CUDA IPC export")
        return open_handle(handle.cuda, handle.nbytes)
    if handle.kind == "shm":
        if not os.path.exists(handle.path):
            raise FileNotFoundError(f"KV segment {handle.path} is gone (cache service restarted?)")
        return torch.from_file(handle.path, shared=True, size=handle.nbytes, dtype=torch.uint8)
    raise ValueError(f"unknown pool handle kind {handle.kind!r}")
