"""Start the cache and compute services as local processes (`nanokv up`, `nanokv generate --split`).

Both get the same EngineConfig (as --config-json) and listen on unix sockets in a private run
directory; the call returns once both answer grpc.health.v1 with SERVING (the compute service
after loading the model and attaching to the cache service's pool). No torch here: the caller is
the gateway process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from nanokv.rpc import wait_serving

START_TIMEOUT_S = 600.0  # loading a large model on a busy machine


@dataclass
class Services:
    cache_address: str
    compute_address: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    run_dir: str = ""

    def stop(self, timeout_s: float = 10.0) -> None:
        for p in reversed(self.procs):  # compute first: it detaches before the pool goes
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = ""

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM when the process that started it dies, however it
    dies (uvicorn re-raises the SIGTERM it handled, so `nanokv up` ends without running its cleanup)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def service_command(kind: str, config: dict[str, Any], listen: str, cache: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "nanokv.cli", kind, "--listen", listen, "--config-json", json.dumps(config)]
    return cmd + (["--cache", cache] if cache else [])


def start_services(config: dict[str, Any], run_dir: str | None = None, log_dir: str | None = None,
                   timeout_s: float = START_TIMEOUT_S) -> Services:
    """config: EngineConfig keys (without the addresses)."""
    own = run_dir is None
    run_dir = run_dir or tempfile.mkdtemp(prefix="nanokv-")
    svc = Services(f"unix:{os.path.join(run_dir, 'cache.sock')}", f"unix:{os.path.join(run_dir, 'compute.sock')}",
                   run_dir=run_dir if own else "")
    logs = log_dir or run_dir
    try:
        for kind, cmd in (("cache", service_command("cache", config, svc.cache_address)),
                          ("compute", service_command("compute", config, svc.compute_address, svc.cache_address))):
            out = open(os.path.join(logs, f"{kind}.log"), "ab")  # noqa: SIM115 - the child keeps it
            svc.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              preexec_fn=_die_with_parent if sys.platform == "linux" else None))
            out.close()
        deadline = time.monotonic() + timeout_s
        for p, address, kind in zip(svc.procs, (svc.cache_address, svc.compute_address), ("cache", "compute")):
            while True:
                if p.poll() is not None:
                    tail = _tail(os.path.join(logs, f"{kind}.log"))
                    raise RuntimeError(f"the {kind} service exited with {p.returncode}:\n{tail}")
                try:
                    wait_serving(address, min(5.0, max(0.1, deadline - time.monotonic())))
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise
    except BaseException:
        svc.stop()
        raise
    return svc


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
        return data[-n:].decode(errors="replace")
    except OSError:
        return ""
