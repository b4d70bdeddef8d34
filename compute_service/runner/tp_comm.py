"""How tensor-parallel ranks find each other: rendezvous, process groups and their timeouts.

Three roles, at most three groups:
  * the default group (gloo): rendezvous and start-up hand-shakes, with a bounded timeout, so a
    rank that never shows up fails start-up instead of hanging it;
  * the control group (gloo): rank 0 broadcasts each step to the workers. Workers wait on it while
    the engine is idle, possibly for days, so its timeout is effectively infinite; a rank that dies
    closes its sockets, which gloo reports at once, so this wait never outlives rank 0;
  * the data group: the model's all_reduce / all_gather. On CPU it is the default gloo group; on
    CUDA a separate NCCL group (NCCL cannot carry the CPU control tensors).

No fixed ports: without MASTER_ADDR/MASTER_PORT, rank 0 hosts a TCPStore on port 0 and the kernel
picks a free port, which is handed to the spawned workers (no bind-close-rebind race). Under
torchrun the env:// rendezvous torchrun prepared is used as is.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed (or never started); the engine cannot continue."""


CTRL_TIMEOUT = timedelta(days=3650)  # idle workers wait for the next step; see the module docstring
_STARTED_KEY = "nanokv/tp/started"


def data_timeout() -> timedelta:
    """Longest time one rank may wait for the others inside a step or during start-up.

    It bounds a hung (not dead) peer; a generous default covers a slow first step (JIT compiles,
    CUDA graph capture) that one rank may finish long before another.
    """
    return timedelta(seconds=float(os.environ.get("NANOKV_TP_TIMEOUT_S", "300")))


def start_timeout_s() -> float:
    """How long rank 0 waits for spawned workers to import torch and check in."""
    return float(os.environ.get("NANOKV_TP_START_TIMEOUT_S", "300"))


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int


def torchrun_env() -> TorchrunEnv | None:
    """RANK/WORLD_SIZE/LOCAL_RANK as torchrun sets them, or None outside a multi-process launch."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if world <= 1:
        return None
    return TorchrunEnv(rank, world, int(os.environ.get("LOCAL_RANK", rank)))


def host_store(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store for spawned workers: MASTER_ADDR/MASTER_PORT if set, else a free port."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "0"))
    try:
        return dist.TCPStore(addr, port, world_size, is_master=True, wait_for_workers=False,
                             timeout=data_timeout())
    except (RuntimeError, OSError) as e:
        hint = " (set by MASTER_PORT)" if port else ""
        raise RuntimeError(f"cannot host the tensor-parallel rendezvous on {addr}:{port}{hint}: {e}") from e


def join_store(addr: str, port: int, world_size: int) -> dist.TCPStore:
    """A spawned worker's connection to rank 0's store; announces that this worker is up."""
    store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=data_timeout())
    store.add(_STARTED_KEY, 1)
    return store


def num_started(store: dist.TCPStore) -> int:
    """Workers that have checked in so far (add 0 reads the counter without blocking)."""
    return int(store.add(_STARTED_KEY, 0))


def init_groups(rank: int, world_size: int, store: dist.TCPStore | None) -> Any:
    """Join the default (gloo) group and create the control group. Returns the control group.

    Every rank calls this, then `make_data_group`, in the same order (group creation is collective).
    """
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; nanokv's "
                           "tensor parallelism needs its own process group (one TP engine per process)")
    if store is None:  # torchrun: MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE in the environment
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size,
                                timeout=data_timeout())
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=data_timeout())
    return dist.new_group(backend="gloo", timeout=CTRL_TIMEOUT)


def make_data_group(device: torch.device) -> Any:
    """The group for the model's collectives: the default gloo group on CPU, a NCCL group on CUDA."""
    if device.type == "cuda":
        return dist.new_group(backend="nccl", timeout=data_timeout())
    return None


def broadcast_object(obj: Any, group: Any = None) -> Any:
    """Rank 0's `obj` on every rank (pickled: start-up only, never per step)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def broadcast_int(value: int, group: Any = None) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, src=0, group=group)
    return int(t.item())


def abort_groups() -> None:
    """Tear down every group without waiting for peers (used after a rank died)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort()
        elif dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort on an already broken group
        pass


def leave_groups(nccl: bool, runner: Any = None) -> None:
    """Orderly exit from every group, once all ranks agreed to stop.

    With NCCL, destroy_process_group and abort both wait forever while CUDA graphs that captured
    its collectives are alive (seen on 2 x H200, torch 2.11): free the runner's graphs first."""
    if nccl:
        if getattr(runner, "graphs", None) is not None:
            runner.graphs = None
            gc.collect()
            torch.cuda.synchronize()
        abort_groups()
    elif dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - peers may already be gone
            abort_groups()
