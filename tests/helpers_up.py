"""`nanokv up` (cache, compute and gateway as three supervised processes) for the tests that need all three."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from nanokv.cache_service.segments import PREFIX, shm_dir
from tests.helpers_grpc import free_port

STARTED = re.compile(r"\b(?:started|restarted) (\w+) \(pid (\d+)\)")


@dataclass
class Up:
    base: str  # the gateway's HTTP base URL
    run_dir: Path
    proc: subprocess.Popen

    @property
    def out_path(self) -> Path:
        return self.run_dir / "up.out"

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def pids(self) -> dict[str, int | None]:
        """<run-dir>/pids.json: {"up": pid, "cache"|"compute"|"gateway": pid or null while restarting}."""
        return json.loads((self.run_dir / "pids.json").read_text())

    def every_pid(self) -> dict[str, set[int]]:
        """Every process the supervisor ran, by service, from its log."""
        seen: dict[str, set[int]] = {}
        for name, pid in STARTED.findall(self.output()):
            seen.setdefault(name, set()).add(int(pid))
        return seen


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def segments_of(pids: set[int]) -> list[str]:
    """The KV segments in shared memory owned (by name) by these cache service pids."""
    return [n for n in os.listdir(shm_dir()) if any(n.startswith(f"{PREFIX}{p}-") for p in pids)]


def assert_stopped_clean(up: Up, timeout_s: float = 10.0) -> None:
    """After `up` exited: no process it started is left, nor a KV segment of its cache services,
    nor its pids.json."""
    seen = up.every_pid()
    assert set(seen) == {"cache", "compute", "gateway"}, up.output()[-3000:]
    pids = set().union(*seen.values())
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if alive(p)] == [], up.output()[-3000:]
    assert segments_of(seen["cache"]) == []
    assert not (up.run_dir / "pids.json").exists()


@contextlib.contextmanager
def up_process(run_dir: Path, *flags: str, env: dict[str, str] | None = None, stop: int = signal.SIGTERM,
               stop_timeout_s: float = 60, client: httpx.Client | None = None) -> Iterator[Up]:
    """Starts `nanokv up --run-dir run_dir --num-gpu-blocks 256 *flags` on a free port (its output in
    run_dir/up.out) and yields once the gateway's /health answers 200 (300 s at most). On the way out:
    `stop` (a signal), then every process it started must be gone, with their KV segments.

    `env` defaults to this process's; PYTHONUNBUFFERED is set so that the output is complete. With
    `client` (an HTTPS client: `up` given --ssl-* flags) the base URL is https and /health is asked through it."""
    port = free_port()
    with open(run_dir / "up.out", "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "nanokv.cli", "up", "--port", str(port), "--run-dir",
                                 str(run_dir), "--num-gpu-blocks", "256", *flags],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"})
    up = Up(f"{'https' if client is not None else 'http'}://127.0.0.1:{port}", run_dir, proc)
    get = client.get if client is not None else httpx.get
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, up.output()[-3000:]
            assert time.monotonic() < deadline, "gateway not healthy"
            try:
                if get(f"{up.base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield up
    finally:
        if proc.poll() is None:
            proc.send_signal(stop)
        try:
            rc = proc.wait(stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, up.output()[-3000:]
    assert_stopped_clean(up)


@contextlib.contextmanager
def nanokv_up(run_dir: Path, *flags: str, env: dict[str, str] | None = None,
              stop_timeout_s: float = 60) -> Iterator[str]:
    """up_process, yielding the gateway's base URL."""
    with up_process(run_dir, *flags, env=env, stop_timeout_s=stop_timeout_s) as up:
        yield up.base
