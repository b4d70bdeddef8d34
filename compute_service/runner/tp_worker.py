"""Tensor-parallel worker: ranks 1..N-1 hold their model and KV-cache shards and replay the steps
rank 0 broadcasts; rank 0 (the engine's TPModelRunner) decides everything.

Three ways in:
  * `spawn_main` - what TPModelRunner starts with torch.multiprocessing (one host, the default);
  * `python -m nanokv.compute_service.runner.tp_worker ARGS` under torchrun - rank 0 runs `nanokv ARGS`, the other
    ranks serve it (see docs/tensor-parallel.md);
  * `run_worker_if_torchrun()` - the first line of a user script launched by torchrun: ranks > 0
    serve rank 0's engine and exit, rank 0 returns and goes on to build its engine.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from nanokv.compute_service.distributed import init_tensor_parallel
from nanokv.compute_service.runner.kv_pool import RankPools
from nanokv.compute_service.runner.model_runner import ModelRunner, resolve_device, resolve_dtype
from nanokv.compute_service.runner.tp_comm import (
    broadcast_int,
    broadcast_object,
    init_groups,
    join_store,
    leave_groups,
    make_data_group,
    torchrun_env,
)
from nanokv.compute_service.runner.tp_protocol import Step, recv
from nanokv.config import ComputeConfig


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit as soon as `parent_pid` is no longer our parent.

    A SIGKILLed engine runs no atexit hook; its workers are re-parented and must not linger. (A
    worker blocked on a dead rank 0 also fails its receive, but one busy loading weights would not.)
    """
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(3)

    threading.Thread(target=watch, name="nanokv-tp-parent-watch", daemon=True).start()


def load_shard(cfg: ComputeConfig, device: torch.device, dtype: torch.dtype, rank: int, size: int):
    """This rank's shard of the model the engine loads (same seed, so random weights agree)."""
    from nanokv.compute_service.model.loader import load_model, random_model

    if cfg.model is not None and cfg.model.startswith("random:"):
        name = cfg.model[len("random:"):]
        return random_model(name, dtype, device, seed=cfg.seed, tp_rank=rank, tp_size=size)
    return load_model(cfg.model, dtype, device, tp_rank=rank, tp_size=size)


def _device(cfg: ComputeConfig, local_rank: int, world: int) -> torch.device:
    device = resolve_device(cfg)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:
        # ranks share the host's cores and run in lock step: oversubscription stalls all of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return device


def serve(rank: int, world: int, local_rank: int, store: dist.TCPStore | None) -> None:
    """Join rank 0's group, build this rank's shard and runner, and run steps until told to stop.

    The order of collectives mirrors TPModelRunner.__init__ exactly.
    """
    ctrl = init_groups(rank, world, store)
    cfg: ComputeConfig = broadcast_object(None)
    device = _device(cfg, local_rank, world)
    dtype = resolve_dtype(cfg, device)
    init_tensor_parallel(rank, world, make_data_group(device))
    torch.manual_seed(cfg.seed)
    model, mc = load_shard(cfg, device, dtype, rank, world)
    # rank 0 sized the cache; every rank allocates exactly that many blocks so block ids agree
    cfg = dataclasses.replace(cfg, num_gpu_blocks=broadcast_int(0))
    handles = broadcast_object(None)  # this rank's pool from the cache service, via rank 0 (None: our own)
    runner = ModelRunner(cfg, model, mc, device, dtype, num_kv_heads_local=mc.heads_per_rank(world, rank)[1],
                         attach_pool=RankPools(handles) if handles is not None else None)
    dist.barrier()
    while (msg := recv(ctrl)) is not None:
        if isinstance(msg, Step):
            runner.execute(msg.items, msg.logits_rows, msg.all_logits, ids_from_rank0=msg.fed)
        else:
            method, args, kwargs = msg
            getattr(runner, method)(*args, **kwargs)
    leave_groups(device.type == "cuda", runner)


def spawn_main(index: int, world: int, addr: str, port: int, parent_pid: int) -> None:
    """torch.multiprocessing target: worker `index` is rank index + 1 (rank 0 is the engine)."""
    # Ctrl-C in a terminal reaches the whole process group; only the engine should act on it (and
    # then stop its workers in order). torch's PDEATHSIG is SIGINT too, so watch_parent covers it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent(parent_pid)
    rank = index + 1
    serve(rank, world, rank, join_store(addr, port, world))


def run_worker_if_torchrun() -> None:
    """Under torchrun, ranks > 0 serve rank 0's engine here and then exit; rank 0 returns."""
    env = torchrun_env()
    if env is None or env.rank == 0:
        return
    watch_parent(os.getppid())  # torchrun's agent: if it dies, so do we
    serve(env.rank, env.world_size, env.local_rank, None)
    sys.exit(0)
