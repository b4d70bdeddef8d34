"""TPModelRunner: rank 0 of a tensor-parallel group, a drop-in for ModelRunner inside the Engine.

Rank 0 is the engine process. It holds its own model shard and a normal ModelRunner over it; the
cache manager, scheduler and sampler run here only. Each `execute` first broadcasts the step
(tp_protocol) so that every worker (tp_worker) runs the same forward on its shard, in lock step,
meeting at the model's all_reduce / all_gather. Only rank 0's logits are used.

Failure handling, the part that keeps a TP engine from hanging:
  * tp_procs watches the spawned workers and records why one died (traceback or signal);
  * rank 0's pending gloo collective fails at once when a peer's socket closes; NCCL does not, so
    on CUDA the watchdog aborts the groups to unblock it;
  * any failure inside a step is fatal for the group (the ranks would be out of step): the runner
    shuts down and raises TensorParallelError naming the rank and the cause, and so does every
    later call;
  * workers leave on STOP (shutdown, atexit) and on their parent's death (tp_worker.watch_parent).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import inspect
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from nanokv.compute_service.distributed import init_tensor_parallel
from nanokv.compute_service.runner.kv_pool import RankPools
from nanokv.compute_service.runner.model_runner import ModelRunner
from nanokv.compute_service.runner.tp_comm import (
    TensorParallelError,
    TorchrunEnv,
    abort_groups,
    broadcast_int,
    broadcast_object,
    host_store,
    init_groups,
    leave_groups,
    make_data_group,
    torchrun_env,
)
from nanokv.compute_service.runner.tp_procs import WorkerProcesses
from nanokv.compute_service.runner.tp_protocol import send_call, send_step, send_stop
from nanokv.config import ComputeConfig
from nanokv.errors import ConfigError, PreconditionError
from nanokv.messages import PoolHandle, PoolLayout

# ModelRunner methods that never run the model, safe to call on rank 0 alone
_RANK0_ONLY_METHODS = frozenset({"bytes_per_block_all_layers", "build_metadata", "check_repool", "layout_for"})


class TPModelRunner:
    def __init__(self, cfg: ComputeConfig, model: Any, model_config, device: torch.device,
                 dtype: torch.dtype, attach_pool: Any = None, free_segment: Callable[[int], None] | None = None):
        """attach_pool: the KV pools from the cache service, one per rank: rank 0 asks for all of
        them (PoolLayout.rank_kv_heads) and sends the others theirs. Under torchrun (ranks may sit on
        other hosts) only rank 0's comes from the cache service; the other ranks allocate their own.
        free_segment(epoch): the in-process cache service frees every rank's segment once an in-place
        change has moved all layers out of them, on every rank (_in_place)."""
        self.world = world = cfg.tensor_parallel_size
        self._mc, self._device = model_config, device
        self._workers: WorkerProcesses | None = None  # spawn mode; torchrun owns its processes
        self._ctrl: Any = None
        self._closed = False
        self._error: str | None = None  # the error every call after a failure repeats
        self.local: ModelRunner | None = None
        self._nccl = device.type == "cuda"
        env = torchrun_env()
        _check_launch(cfg, model, device, env)
        self._attach = attach_pool if env is None else None  # every rank's pool from the cache service
        self._free_segment = free_segment
        self._rank_handles: list[PoolHandle] | None = None
        self._atexit = _atexit_hook(weakref.ref(self))  # weak: the hook must not keep us alive
        atexit.register(self._atexit)
        # NCCL collectives do not notice a dead peer (gloo ones fail at once): abort them
        on_failure = abort_groups if self._nccl else (lambda: None)
        try:
            store = None
            if env is None:
                store = host_store(world)
                self._workers = WorkerProcesses(world, os.environ.get("MASTER_ADDR", "127.0.0.1"), store,
                                                on_failure)
                self._workers.wait_started(store)
            # the collectives below mirror tp_worker.serve, in the same order
            self._ctrl = init_groups(0, world, store)
            broadcast_object(cfg)
            init_tensor_parallel(0, world, make_data_group(device))
            _, kv_heads = model_config.heads_per_rank(world, 0)
            self.local = ModelRunner(cfg, model, model_config, device, dtype, num_kv_heads_local=kv_heads,
                                     attach_pool=functools.partial(self._attach_ranks, attach_pool)
                                     if self._attach is not None else attach_pool)
            # rank 0 sized the cache; every rank gets that many blocks (each over its own kv heads;
            # rank 0 holds the most, so its count fits the others when heads split unevenly)
            broadcast_int(self.local.num_blocks)
            broadcast_object(self._rank_handles)  # None: the workers allocate their own
            dist.barrier()  # every worker has its shard and its cache
        except BaseException as e:
            raise self._fatal(e, "start-up") from e

    # ---- what the engine reads --------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # rank 0's runner answers for its attributes (num_blocks, kv_caches, block_size, model, ...)
        # and for methods known not to run the model. Any other method might: run on rank 0
        # alone it would wait for workers that never join its collectives, so refuse it loudly.
        local = self.__dict__.get("local")
        if local is None:
            raise AttributeError(name)
        value = getattr(local, name)
        if inspect.ismethod(value) and name not in _RANK0_ONLY_METHODS:
            raise AttributeError(f"TPModelRunner.{name}: a runner method that may run the model must run on "
                                 f"every rank: use runner.call_all({name!r}, ...) or add a wrapper to "
                                 "compute_service/runner/tp_runner.py")
        return value

    def worker_pids(self) -> list[int]:
        """Process ids of the spawned workers (empty under torchrun, which owns its processes)."""
        return [] if self._workers is None else self._workers.pids()

    # ---- running the model on every rank ----------------------------------------------------
    def execute(self, items, logits_rows: list[int] | None = None, all_logits: bool = False,
                feed: tuple[torch.Tensor, list[int], list[int]] | None = None) -> torch.Tensor | None:
        """ModelRunner.execute on every rank; returns rank 0's logits. feed (async scheduling): the
        previous step's samples are on rank 0's device only, so rank 0 sends the fed input ids."""
        local = self._usable()
        fed = feed is not None and bool(feed[1])
        try:
            send_step(self._ctrl, items, logits_rows, all_logits, fed)
            return local.execute(items, logits_rows, all_logits, feed=feed, ids_from_rank0=fed)
        except BaseException as e:
            raise self._fatal(e, "a step") from e

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`ModelRunner.method(*args, **kwargs)` on every rank in lock step; returns rank 0's result.

        For runner methods that run the model outside `execute` (warm-up, CUDA graph capture):
        through plain attribute access they would run on rank 0 alone and wait at the first
        collective for workers that never come."""
        local = self._usable()
        try:
            send_call(self._ctrl, method, args, kwargs)
            return getattr(local, method)(*args, **kwargs)
        except BaseException as e:
            raise self._fatal(e, f"call_all({method!r})") from e

    def capture_cudagraphs(self, max_model_len: int) -> None:
        """Every rank captures at once: warm-up runs and the graphs contain the model's collectives."""
        self.call_all("capture_cudagraphs", max_model_len)

    def resize_kv(self, num_blocks: int) -> None:
        """Every rank resizes its KV shard (and re-captures its graphs, which contain collectives)
        in lock step: the adaptive pool rule (nanokv.compute_service.adaptive.pool). A failure there, out of memory
        included, is fatal for the group like any other."""
        self._in_place("resize_kv", num_blocks)

    def reformat_kv(self, changes: dict[int, int]) -> None:
        """Every rank re-formats its shard of these layers in place (and captures its graphs again)
        in lock step: the adaptive KV-width rule in one process (nanokv.compute_service.adaptive.precision)."""
        self._in_place("reformat_kv", changes)

    def _in_place(self, method: str, *args: Any) -> None:
        """An in-place change on every rank; if it moved the last layers out of the segments, free them
        once every rank is past its copy (rank 0's runner tracks the same layers as every other's)."""
        local = self._usable()
        held = local.segment_epoch
        self.call_all(method, *args)
        if held is not None and local.segment_epoch is None and self._free_segment is not None:
            self.call_all("sync_ranks")
            self._free_segment(held)

    # ---- the KV pools (one per rank, from the cache service) ------------------------------------
    def _with_ranks(self, layout: PoolLayout) -> PoolLayout:
        """Rank 0's layout plus what the other ranks' pools hold: their KV heads, their devices
        (spawned rank r runs on cuda:r, tp_worker._device)."""
        r = range(1, self.world)
        return dataclasses.replace(
            layout, rank_kv_heads=[self._mc.heads_per_rank(self.world, i)[1] for i in r],
            rank_devices=[str(self._device) if self._device.type == "cpu" else f"cuda:{i}" for i in r])

    def _attach_ranks(self, attach_pool: Callable[[PoolLayout], PoolHandle], layout: PoolLayout) -> PoolHandle:
        """Rank 0's attach, asking for every rank's pool; keeps the other ranks' handles to send them."""
        handle = attach_pool(self._with_ranks(layout))
        self._rank_handles = handle.ranks
        return handle

    def repool(self, attach_pool: Callable[[PoolLayout], PoolHandle], num_blocks: int | None = None,
               layer_bits: list[int] | None = None) -> None:
        """ModelRunner.repool on every rank: all drop their views of the old pools, rank 0 attaches
        the new layout for all of them, then each carves its own and captures its graphs, in lock step."""
        local = self._usable()
        if self._attach is None:
            raise PreconditionError("compute", "a pool change needs every rank's pool from the cache service; "
                                               "tensor-parallel ranks started by torchrun allocate their own")
        n, bits = local.check_repool(num_blocks, layer_bits)  # a bad layout changes nothing
        self.call_all("release_pool", True)  # the old pools' memory goes before the new ones are allocated
        try:
            handle = self._attach_ranks(attach_pool, local.layout_for(n, bits))
            send_call(self._ctrl, "repool", (RankPools(handle.ranks), n, bits), {})
            local.repool(lambda _layout: handle, n, bits)
        except BaseException as e:
            raise self._fatal(e, "a repool") from e

    def remap_pool(self, attach_pool: Callable[[PoolLayout], PoolHandle]) -> None:
        """A restarted cache service: every rank maps a new pool of the same layout (its contents are lost)."""
        self.repool(attach_pool)

    def release_pool(self, collect: bool = False) -> None:
        self.call_all("release_pool", collect)

    @property
    def follows_cache_pool(self) -> bool:
        """Every rank's pool comes from the cache service, so it can follow a restart or a repool."""
        return self._attach is not None

    def _usable(self) -> ModelRunner:
        if self._closed or self.local is None:
            raise TensorParallelError(self._error or "the tensor-parallel engine was shut down")
        if self._workers is not None and self._workers.failure is not None:
            raise self._fatal(RuntimeError("worker exited"), "an idle period")  # died between steps
        return self.local

    # ---- failure and shutdown ---------------------------------------------------------------
    def _fatal(self, e: BaseException, when: str) -> BaseException:
        """Shut everything down after a failure; return the error to raise (why, and which rank)."""
        failure = None
        if self._workers is not None and isinstance(e, Exception):
            failure = self._workers.wait_for_failure()
        self._shutdown(graceful=False)  # the ranks are out of step: no STOP, just end them
        if not isinstance(e, Exception) or isinstance(e, TensorParallelError):
            self._error = str(e) or f"the tensor-parallel engine stopped on {type(e).__name__}"
            return e  # KeyboardInterrupt / SystemExit keep their meaning; ours are clear already
        if failure is not None:
            self._error = f"tensor-parallel worker {failure}\nThe engine stopped during {when}."
        elif self._workers is None and self._ctrl is not None:
            self._error = f"a tensor-parallel peer failed during {when}: {type(e).__name__}: {e}"
        else:
            self._error = f"tensor-parallel rank 0 failed during {when}: {type(e).__name__}: {e}"
        return TensorParallelError(self._error)

    def shutdown(self) -> None:
        """Stop the workers (STOP, then terminate stragglers) and leave the group. Idempotent; also
        runs at interpreter exit."""
        self._shutdown(graceful=True)

    def _shutdown(self, graceful: bool) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        failed = self._workers is not None and self._workers.failure is not None
        graceful = graceful and not failed and self._ctrl is not None
        if graceful:
            try:
                send_stop(self._ctrl)
            except Exception:  # noqa: BLE001 - a worker is already gone; terminate below
                graceful = False
        if self._workers is not None:
            self._workers.stop(grace_s=5.0 if graceful else 0.0)
        if graceful:
            leave_groups(self._nccl, self.local)
        else:
            abort_groups()
        init_tensor_parallel(0, 1)


def _atexit_hook(ref: weakref.ReferenceType[TPModelRunner]) -> Callable[[], None]:
    def hook() -> None:
        runner = ref()
        if runner is not None:
            runner.shutdown()

    return hook


def _check_launch(cfg: ComputeConfig, model: torch.nn.Module, device: torch.device,
                  env: TorchrunEnv | None) -> None:
    """Clear errors for set-ups that cannot work, before any process starts."""
    world = cfg.tensor_parallel_size
    built = getattr(model, "tp_size", world)
    if built != world:
        raise ConfigError("tensor_parallel_size", f"the model was built for tensor parallel size {built}, "
                          f"not {world}; load rank 0's shard with tp_size={world}")
    if dist.is_initialized():
        raise TensorParallelError("torch.distributed is already initialised in this process (another "
                                  "tensor-parallel engine?); shut it down first: one TP engine per process")
    if env is not None:
        if env.rank != 0:
            raise TensorParallelError(f"torchrun rank {env.rank} must serve rank 0 instead of building an "
                                      "engine: call runner.tp_worker.run_worker_if_torchrun() first")
        if env.world_size != world:
            raise ConfigError("tensor_parallel_size", f"got {world} but torchrun started "
                              f"WORLD_SIZE={env.world_size} processes; they must match")
    elif device.type == "cuda" and torch.cuda.device_count() < world:
        raise ConfigError("tensor_parallel_size", f"{world} needs {world} GPUs on this host, "
                          f"found {torch.cuda.device_count()} (use torchrun to span hosts)")
