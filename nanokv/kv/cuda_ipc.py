"""CUDA IPC for the KV pool: the cache service exports its device segment, the compute service opens it.

The segment is one plain device allocation ([nbytes] uint8, from PyTorch's caching allocator,
i.e. cudaMalloc). Exporting goes through PyTorch's own IPC path (UntypedStorage._share_cuda_),
the one torch.multiprocessing uses, because it brings a reference count the two processes share:
while the compute service holds the mapping, the cache service dropping its tensor does not free
the memory (PyTorch keeps the block until the count reaches zero). So exported memory is never
freed while attached.

The pitfalls, and what this module does about them:
  - expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) have no legacy IPC
    handle: the export refuses with an error that says so, before allocating;
  - the two processes must see the same GPU: device indices differ under different
    CUDA_VISIBLE_DEVICES, so the handle carries the GPU's UUID and the importer looks it up;
  - across containers the processes need a shared IPC namespace (`ipc: host`) and the same GPUs
    visible; opening fails otherwise, and the error names both;
  - a process cannot open its own handle (CUDA refuses): the in-process transport passes the
    tensor itself (PoolHandle kind "local").
"""

from __future__ import annotations

import os

import torch

from nanokv.messages import CudaIpcHandle


class CudaIpcError(RuntimeError):
    pass


def _expandable_segments() -> bool:
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = os.environ.get(var, "").replace(" ", "").lower()
        if "expandable_segments:true" in conf:
            return True
    return False


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def allocate_exportable(nbytes: int, device: torch.device) -> torch.Tensor:
    if _expandable_segments():
        raise CudaIpcError("the KV pool is shared over CUDA IPC, which expandable segments do not support: "
                           "start the cache service without expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF")
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def export(buffer: torch.Tensor) -> CudaIpcHandle:
    """One handle for `buffer` ([n] uint8 on a CUDA device). Each export takes a reference the
    importer gives back when it drops its mapping."""
    storage = buffer.untyped_storage()
    (dev, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
    return CudaIpcHandle(device_uuid=device_uuid(buffer.device), device_index=int(dev), handle=bytes(handle),
                         storage_bytes=int(size), storage_offset=int(offset), ref_counter_handle=bytes(ref_handle),
                         ref_counter_offset=int(ref_offset), event_handle=bytes(event_handle or b""),
                         event_sync_required=bool(event_sync))


def _local_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", i)) == uuid:
            return i
    raise CudaIpcError(f"the cache service's GPU {uuid} is not visible to this process: both services must "
                       f"see the same GPUs (CUDA_VISIBLE_DEVICES / the containers' device reservations)")


def open_handle(h: CudaIpcHandle, nbytes: int) -> torch.Tensor:
    """The compute service's view of the exported segment: [nbytes] uint8 on the same GPU."""
    torch.cuda.init()
    index = _local_index(h.device_uuid)
    try:
        storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
            index, h.handle, h.storage_bytes, h.storage_offset, h.ref_counter_handle, h.ref_counter_offset,
            h.event_handle or None, h.event_sync_required)
    except RuntimeError as e:
        raise CudaIpcError(f"cannot open the KV pool's CUDA IPC handle ({e}); processes in different "
                           f"containers need a shared IPC namespace (ipc: host) and the same GPU") from None
    t = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
    t.set_(storage, 0, (h.storage_bytes,), (1,))  # type: ignore[call-overload]
    if t.numel() < nbytes:
        raise CudaIpcError(f"KV segment of {t.numel()} bytes, the handle promised {nbytes}")
    return t[:nbytes]
