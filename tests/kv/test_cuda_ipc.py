"""The KV pool over CUDA IPC (nanokv/kv/cuda_ipc.py): exported by one process, written by another.

On the CPU: the handle's wire form and the refusals that need no GPU. With a GPU (the device's
check script runs these): a real second process exports a pool segment, this one opens it, and
each side sees the other's writes; the cache service's re-attach of the same layout hands out the
same memory under a new epoch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from nanokv.messages import CudaIpcHandle, PoolHandle, PoolLayout
from nanokv.protos import codec

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")


def test_handle_round_trips_through_protobuf():
    h = PoolHandle("cuda_ipc", 1 << 20, 7, cuda=CudaIpcHandle("GPU-1234", 0, b"\x01" * 64, 2 << 20, 4096, b"ref",
                                                                 3, b"\x02" * 64, True))
    back = codec.handle_from_pb(codec.handle_to_pb(h))
    assert back == h
    shm = codec.handle_from_pb(codec.handle_to_pb(PoolHandle("shm", 10, 1, path="/dev/shm/x")))
    assert shm.cuda is None and shm.path == "/dev/shm/x"


def test_expandable_segments_refused_before_allocating(monkeypatch):
    from nanokv.kv.cuda_ipc import CudaIpcError, allocate_exportable

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(CudaIpcError, match="expandable segments"):
        allocate_exportable(1024, torch.device("cuda"))


def test_unknown_gpu_is_a_clear_error():
    from nanokv.kv.cuda_ipc import CudaIpcError, open_handle

    if not torch.cuda.is_available():
        pytest.skip("opening a handle initialises CUDA")
    with pytest.raises(CudaIpcError, match="not visible to this process"):
        open_handle(CudaIpcHandle("GPU-not-here", 0, b"", 0, 0, b"", 0, b"", False), 16)


_EXPORTER = textwrap.dedent("""
    import sys, torch
    from nanokv.cache_service.service import CacheService
    from nanokv.config import EngineConfig
    from nanokv.messages import PoolLayout
    from nanokv.protos import codec
    svc = CacheService(EngineConfig(device="cuda").cache, shared=True)
    layout = PoolLayout(64, 16, 2, 64, [16, 8], "bfloat16", 0, "cuda")
    h = svc.attach(layout)
    buf = svc.storage.buffer
    buf[:4096] = 7
    torch.cuda.synchronize()
    print(codec.handle_to_pb(h).SerializeToString().hex(), flush=True)
    sys.stdin.readline()                       # the importer wrote its pattern
    torch.cuda.synchronize()
    ok = bool((buf[4096:8192] == 9).all())
    h2 = svc.attach(layout)                    # a restarted compute service: same memory, new epoch
    same = svc.storage.buffer.data_ptr() == buf.data_ptr()
    print(f"{ok} {same} {h.epoch} {h2.epoch}", flush=True)
""")


@needs_cuda
def test_pool_shared_between_processes():
    from nanokv.kv.segment import carve_layer_caches, map_handle

    p = subprocess.Popen([sys.executable, "-c", _EXPORTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=os.environ.copy())
    try:
        assert p.stdout is not None and p.stdin is not None
        line = p.stdout.readline().strip()
        from nanokv.protos import internal_pb2 as pb
        handle = codec.handle_from_pb(pb.PoolHandle.FromString(bytes.fromhex(line)))
        assert handle.kind == "cuda_ipc" and handle.cuda is not None
        seg = map_handle(handle)
        assert seg.is_cuda and seg.numel() == handle.nbytes
        assert bool((seg[:4096] == 7).all())  # the exporter's write, seen here
        # the carved layers are views of that memory on both sides
        layers = carve_layer_caches(PoolLayout(64, 16, 2, 64, [16, 8], "bfloat16", 0, "cuda"), seg)
        assert seg.data_ptr() <= layers[0].k.data_ptr() < seg.data_ptr() + seg.numel()
        seg[4096:8192] = 9
        torch.cuda.synchronize()
        p.stdin.write("\n")
        p.stdin.flush()
        ok, same, e1, e2 = p.stdout.readline().split()
        assert ok == "True", "the exporter did not see this process's write"
        assert same == "True" and int(e2) == int(e1) + 1
    finally:
        p.kill()
        p.wait()


_RANK_WRITER = textwrap.dedent("""
    import sys, torch
    from nanokv.kv.segment import map_handle
    from nanokv.protos import codec, internal_pb2 as pb
    seg = map_handle(codec.handle_from_pb(pb.PoolHandle.FromString(bytes.fromhex(sys.argv[1]))))
    seg[:4096] = 5
    if seg.is_cuda:
        torch.cuda.synchronize()
    print(seg.numel(), flush=True)
""")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_rank_pools_are_exported_even_by_an_in_process_cache_service(device):
    """Tensor parallelism: the cache service allocates one pool per further rank, with that rank's KV
    heads, always shareable (the ranks are other processes): another process maps rank 1's pool and
    its write is seen here; closing the storage removes a shared-memory file."""
    from nanokv.cache_service.service import CacheService
    from nanokv.config import EngineConfig
    from nanokv.kv.segment import pool_nbytes

    svc = CacheService(EngineConfig(device=device).cache)  # the in-process transport: rank 0's pool is "local"
    layout = PoolLayout(64, 16, 2, 64, [16, 8], "bfloat16", 0, device, rank_kv_heads=[1], rank_devices=[device])
    h = svc.attach(layout)
    assert h.kind == "local" and len(h.ranks) == 1
    rank1 = h.ranks[0]
    assert rank1.kind == ("cuda_ipc" if device == "cuda" else "shm") and rank1.epoch == h.epoch
    assert rank1.nbytes == pool_nbytes(PoolLayout(64, 16, 1, 64, [16, 8], "bfloat16", 0, device)) < h.nbytes
    out = subprocess.run([sys.executable, "-c", _RANK_WRITER, codec.handle_to_pb(rank1).SerializeToString().hex()],
                         capture_output=True, text=True, env=os.environ.copy(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == rank1.nbytes
    buf = svc.storage.ranks[0].buffer
    assert bool((buf[:4096] == 5).all()) and not bool((buf[4096:8192] != 0).any())
    path = svc.storage.ranks[0].path
    svc.close()
    assert device == "cuda" or not os.path.exists(path)
