"""The three services as local processes (what `nanokv up` starts), each of which can be killed,
stopped and restarted alone: what the fault tests and `nanokv soak` drive.

The cache and compute services listen on unix sockets in `run_dir` (nanokv.launch), the gateway
on two free loopback ports (HTTP and the public gRPC API). A restarted service gets the same
address and config, so the others find it again by themselves (docs/services.md, Failures).
No torch here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from nanokv.launch import _die_with_parent, service_command, start_services
from nanokv.rpc import wait_serving

KINDS = ("cache", "compute", "gateway")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_status(url: str, timeout_s: float = 2.0) -> int:
    """The status of GET `url` (0: no answer). The standard library's client: the gateway's own
    dependencies have none."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, ValueError):
        return 0


@dataclass
class Stack:
    config: dict[str, Any]  # EngineConfig keys of the cache and compute services
    gateway_config: dict[str, Any]  # the gateway's (the same, plus e.g. a shorter rpc_timeout_s)
    run_dir: str
    api_keys: tuple[str, ...] = ()
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    cache_address: str = ""
    compute_address: str = ""
    http_port: int = 0
    grpc_port: int = 0

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @classmethod
    def start(cls, config: dict[str, Any], run_dir: str, *, gateway_config: dict[str, Any] | None = None,
              api_keys: tuple[str, ...] = (), timeout_s: float = 300.0) -> Stack:
        svc = start_services(config, run_dir=run_dir, timeout_s=timeout_s)
        stack = cls(config, {**config, **(gateway_config or {})}, run_dir, tuple(api_keys),
                    {"cache": svc.procs[0], "compute": svc.procs[1]}, svc.cache_address, svc.compute_address,
                    free_port(), free_port())
        try:
            stack.restart("gateway", timeout_s)
        except BaseException:
            stack.stop()
            raise
        return stack

    def pid(self, kind: str) -> int:
        return self.procs[kind].pid

    def _command(self, kind: str) -> list[str]:
        if kind == "cache":
            return service_command("cache", self.config, self.cache_address)
        if kind == "compute":
            return service_command("compute", self.config, self.compute_address, self.cache_address)
        keys = [a for k in self.api_keys for a in ("--api-key", k)]
        return [sys.executable, "-m", "nanokv.cli", "gateway", "--cache", self.cache_address, "--compute",
                self.compute_address, "--host", "127.0.0.1", "--port", str(self.http_port), "--grpc-port",
                str(self.grpc_port), "--log-level", "warning", "--wait-s", "60",
                "--config-json", json.dumps(self.gateway_config), *keys]

    def kill(self, kind: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[kind]
        os.kill(p.pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            p.wait(30)

    def restart(self, kind: str, timeout_s: float = 300.0) -> None:
        """Start `kind` again (it must have exited) and wait until it serves: SERVING on its socket
        (cache, compute), /health 200 (gateway; it may not be ready until its peers are)."""
        old = self.procs.get(kind)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"the {kind} service is still running (pid {old.pid})")
        with open(os.path.join(self.run_dir, f"{kind}.log"), "ab") as log:
            self.procs[kind] = subprocess.Popen(
                self._command(kind), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        if kind == "gateway":
            self.wait_http("/health", timeout_s)
        else:
            wait_serving(self.cache_address if kind == "cache" else self.compute_address, timeout_s)

    def wait_http(self, path: str, timeout_s: float) -> float:
        """Seconds until GET `path` answers 200 (raises TimeoutError, or RuntimeError if the gateway died)."""
        t0 = time.monotonic()
        while True:
            gw = self.procs["gateway"]
            if gw.poll() is not None:
                raise RuntimeError(f"the gateway exited with {gw.returncode}:\n{self.log_tail('gateway')}")
            if http_status(self.http + path) == 200:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{path} not 200 after {timeout_s:.0f} s")
            time.sleep(0.1)

    def wait_ready(self, timeout_s: float = 120.0) -> float:
        return self.wait_http("/ready", timeout_s)

    def log_tail(self, kind: str, n: int = 3000) -> str:
        try:
            with open(os.path.join(self.run_dir, f"{kind}.log"), "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        for kind in ("gateway", "compute", "cache"):  # compute before cache: it detaches first
            p = self.procs.pop(kind, None)
            if p is None or p.poll() is not None:
                continue
            try:
                os.kill(p.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            except ProcessLookupError:
                continue
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
