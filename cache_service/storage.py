"""KV storage: the segment that holds the pool's tensors, allocated and owned by the cache service.

Its layout (which tensor sits at which offset, for every layer and format) is nanokv.kv.segment's,
shared with the compute service, which maps the same bytes once when it attaches. Kinds of segment:
  local  same process (the in-process transport): the handle carries the tensor itself
  shm    a file in /dev/shm (or the temp dir) of `nbytes`, mapped shared by both processes
         (torch.from_file(shared=True) is mmap MAP_SHARED); the cache service creates and removes it
  cuda_ipc  a device allocation of the cache service's, exported over CUDA IPC
         (nanokv.kv.cuda_ipc); the compute service opens it once

The only module of the cache service that imports torch.
"""

from __future__ import annotations

import dataclasses
import os
import weakref

import numpy as np
import torch

from nanokv.cache_service.segments import new_segment_path
from nanokv.kv.segment import pool_nbytes
from nanokv.messages import PoolHandle, PoolLayout


def rank_layouts(layout: PoolLayout) -> list[PoolLayout]:
    """Tensor parallelism: the layouts of ranks 1..N-1's pools (rank 0's is `layout` itself): the
    same blocks and widths over each rank's own KV heads, on its own device."""
    if len(layout.rank_kv_heads) != len(layout.rank_devices):
        raise ValueError("rank_kv_heads and rank_devices: one entry per rank after rank 0")
    return [dataclasses.replace(layout, num_kv_heads=heads, device=device, rank_kv_heads=[], rank_devices=[])
            for heads, device in zip(layout.rank_kv_heads, layout.rank_devices)]


def host_layout(layout: PoolLayout, budget_bytes: int, tier_format: str = "pool") -> tuple[PoolLayout, int]:
    """The host tier's layout: the pool's, on the host, in the tier's format (cpu_offload_kv_format:
    the pool's own, or int8 / int4 where that is narrower than a layer's), with as many blocks as
    `budget_bytes` holds; and the bytes one block takes there. A ConfigError when the budget holds
    no block."""
    from nanokv.errors import ConfigError
    from nanokv.kv.tier_transcode import tier_layer_bits

    one = dataclasses.replace(layout, device="cpu", rank_kv_heads=[], rank_devices=[], num_blocks=1024,
                              layer_bits=tier_layer_bits(layout.layer_bits, tier_format))
    fixed = pool_nbytes(dataclasses.replace(one, num_blocks=1))  # (alignment and int4 staging)
    per_block = max(1, (pool_nbytes(one) - fixed) // 1023)
    n = (budget_bytes - fixed) // per_block
    while n > 0 and pool_nbytes(dataclasses.replace(one, num_blocks=n)) > budget_bytes:
        n -= 1
    if n < 1:
        raise ConfigError("cpu_offload_bytes", f"{budget_bytes} bytes hold no KV block of this pool "
                                               f"(one takes about {per_block + fixed} bytes)")
    return dataclasses.replace(one, num_blocks=n), per_block


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
            from nanokv.kv.cuda_ipc import allocate_exportable

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
            from nanokv.kv.cuda_ipc import export

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


class HostSlots:
    """One host-tier slot's bytes across every layer and tensor (cache_service/tiers/serving.py
    SlotBytes): what the disk tier writes and reads. Tensors in the segment's order, each slot's
    [H, bs, D] (or scale) entries in logical order, so a file is independent of strides."""

    def __init__(self, storage: PoolStorage):
        from nanokv.kv.segment import carve_layer_caches

        caches = carve_layer_caches(storage.layout, storage.buffer)
        self.tensors = [getattr(c, f) for c in caches for f in c.block_fields]
        self.num_slots = int(self.tensors[0].shape[0])
        self.slot_bytes = sum(t[0].numel() * t.element_size() for t in self.tensors)
        # per tensor, [slots, bytes of one slot] uint8 over the segment where a slot's entries are
        # contiguous in logical order (a numpy row per slot: no torch call per access), else None
        self._rows = [t.reshape(t.shape[0], -1).view(torch.uint8).numpy() if t[0].is_contiguous() else None
                      for t in self.tensors]

    def views(self, slot: int) -> list[memoryview]:
        """The slot's bytes as one flat byte view per tensor, in file order: views of the segment
        itself where a slot's entries are contiguous (no copy), a contiguous copy where they are
        not (int8 values are dims-major in memory)."""
        return [memoryview(rows[slot]) if rows is not None
                else memoryview(t[slot].contiguous().view(-1).view(torch.uint8).numpy())
                for t, rows in zip(self.tensors, self._rows)]

    def read(self, slot: int) -> bytes:
        """A copy of the slot's bytes: one buffer, one copy per tensor (a strided tensor: two)."""
        return b"".join(self.views(slot))

    def write(self, slot: int, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if view.nbytes != self.slot_bytes:
            raise ValueError(f"a slot holds {self.slot_bytes} bytes, got {view.nbytes}")
        src = np.frombuffer(view, dtype=np.uint8)  # read-only is fine: it is only copied out of
        off = 0
        for t, rows in zip(self.tensors, self._rows):
            dst = t[slot]
            n = dst.numel() * dst.element_size()
            if rows is not None:
                rows[slot] = src[off:off + n]
            else:  # torch would warn about a read-only source: the strided path copies it first
                dst.copy_(torch.from_numpy(src[off:off + n].copy()).view(dst.dtype).view(dst.shape))
            off += n


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
