"""`nanokv bench serve --launch`: the local stack as a child process for the length of the benchmark.

It runs the `nanokv up` (or `nanokv serve`) command itself on free loopback ports and waits for
/ready, so one command measures the local stack; extra server flags pass through unchanged.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

LAUNCH_COMMANDS = ("up", "serve")


@dataclass
class Launched:
    base_url: str
    grpc_address: str
    log_path: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@contextlib.contextmanager
def launch(command: str, extra_args: str, timeout_s: float, log: Callable[[str], None] = print) -> Iterator[Launched]:
    """Starts `nanokv <command> --port P --grpc-port G [--run-dir D] <extra_args>`; yields its addresses
    once /ready answers 200; SIGTERM (then SIGKILL) on the way out."""
    if command not in LAUNCH_COMMANDS:
        raise ValueError(f"launch_command: got {command!r}; allowed: {', '.join(LAUNCH_COMMANDS)}")
    http_port, grpc_port = _free_port(), _free_port()
    with tempfile.TemporaryDirectory(prefix="nanokv-bench-serve-") as run_dir:
        cmd = [sys.executable, "-m", "nanokv.cli", command, "--host", "127.0.0.1", "--port", str(http_port),
               "--grpc-port", str(grpc_port), *shlex.split(extra_args)]
        if command == "up":
            cmd[4:4] = ["--run-dir", run_dir]
        log_path = os.path.join(run_dir, "server.log")
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{http_port}"
        log(f"launched: {shlex.join(cmd)} (pid {proc.pid})")
        try:
            t0 = time.monotonic()
            while not _ready(f"{base}/ready"):
                if proc.poll() is not None:
                    with open(log_path, "rb") as f:
                        tail = f.read()[-3000:].decode(errors="replace")
                    raise RuntimeError(f"`nanokv {command}` exited with {proc.returncode}:\n{tail}")
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"`nanokv {command}` not ready after {timeout_s:.0f} s (log: {log_path})")
                time.sleep(0.2)
            log(f"ready after {time.monotonic() - t0:.1f} s")
            yield Launched(base, f"127.0.0.1:{grpc_port}", log_path)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
