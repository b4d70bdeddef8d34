"""The spawned worker processes of one tensor-parallel engine: start, watch, explain, reap.

A watchdog thread waits on the workers' process sentinels. The moment one exits while it should
not, the watchdog records why (the worker's own traceback, or the signal that killed it), calls
`on_failure` (which unblocks collectives that would not notice by themselves) and ends the other
workers: one dead rank makes the whole group useless, and nothing may be left behind.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing import connection

import torch.distributed as dist
import torch.multiprocessing as mp

from nanokv.compute_service.runner.tp_comm import TensorParallelError, num_started, start_timeout_s
from nanokv.compute_service.runner.tp_worker import spawn_main


class WorkerProcesses:
    def __init__(self, world: int, addr: str, store: dist.TCPStore, on_failure: Callable[[], None]):
        self.failure: str | None = None  # why a worker exited unexpectedly
        self._on_failure = on_failure
        self._stopping = threading.Event()
        self._reap_lock = threading.Lock()  # the watchdog and the engine thread may both reap
        # workers are ranks 1..world-1; each learns its parent's pid to exit if the engine dies
        self._ctx = mp.start_processes(spawn_main, args=(world, addr, store.port, os.getpid()),
                                       nprocs=world - 1, join=False, start_method="spawn")
        self._watchdog = threading.Thread(target=self._watch, name="nanokv-tp-watchdog", daemon=True)
        self._watchdog.start()

    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._ctx.processes]

    def wait_started(self, store: dist.TCPStore) -> None:
        """Block until every worker reached the store, or raise once one died or time ran out.

        Joining the group before that would leave rank 0 waiting out the rendezvous timeout for a
        worker that died while importing."""
        deadline = time.monotonic() + start_timeout_s()
        while num_started(store) < len(self._ctx.processes):
            if self.failure is not None:
                raise TensorParallelError(f"tensor-parallel worker {self.failure}\n"
                                          "The engine stopped during start-up.")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers did not start within "
                                          f"{start_timeout_s():.0f}s (NANOKV_TP_START_TIMEOUT_S)")
            time.sleep(0.02)

    def wait_for_failure(self, max_s: float = 3.0) -> str | None:
        """After rank 0 saw a collective fail: the worker's failure, if that is what it was.

        The collective usually fails a moment before the watchdog sees the process exit; if after
        a short wait every worker is still alive, the failure was rank 0's own."""
        start = time.monotonic()
        while self.failure is None and time.monotonic() - start < max_s:
            if time.monotonic() - start > 0.5 and all(p.is_alive() for p in self._ctx.processes):
                break
            time.sleep(0.02)
        return self.failure

    def _watch(self) -> None:
        procs = self._ctx.processes
        sentinels = {p.sentinel: i for i, p in enumerate(procs)}
        while sentinels and not self._stopping.is_set():
            for s in connection.wait(list(sentinels), timeout=0.25):
                i = sentinels.pop(s)
                if self._stopping.is_set():
                    continue
                procs[i].join()
                self.failure = self._describe_exit(i)
                self._on_failure()
                self.reap(grace_s=1.0)
                return

    def _describe_exit(self, i: int) -> str:
        p, rank = self._ctx.processes[i], i + 1
        err_file = self._ctx.error_files[i]
        if os.access(err_file, os.R_OK):  # torch.multiprocessing saved the worker's traceback
            with open(err_file, "rb") as f:
                return f"rank {rank} (pid {p.pid}) raised:\n{pickle.load(f)}"
        code = p.exitcode
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited unexpectedly with code {code}"
        return f"rank {rank} (pid {p.pid}) {how}"

    def stop(self, grace_s: float) -> None:
        """Expected exits from now on; give the workers `grace_s` to leave, then end them."""
        self._stopping.set()
        self.reap(grace_s)
        if self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=1.0)

    def reap(self, grace_s: float) -> None:
        with self._reap_lock:
            procs = self._ctx.processes
            deadline = time.monotonic() + grace_s
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            for p in procs:
                if p.is_alive():
                    p.terminate()
            deadline = time.monotonic() + 2.0
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join()
