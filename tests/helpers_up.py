"""`nanokv up` (cache, compute and gateway as three processes) for the tests that need all three."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.helpers_grpc import free_port


@contextlib.contextmanager
def nanokv_up(run_dir: Path, *flags: str, env: dict[str, str] | None = None,
              stop_timeout_s: float = 30) -> Iterator[str]:
    """Starts `nanokv up --run-dir run_dir --num-gpu-blocks 256 *flags` on a free port and yields the
    gateway's base URL once its /health answers 200 (300 s at most); SIGTERM on the way out.

    `env` defaults to this process's; PYTHONUNBUFFERED is set so that the output shown when it dies
    early is complete."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nanokv.cli", "up", "--port", str(port), "--run-dir", str(run_dir),
                             "--num-gpu-blocks", "256", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "gateway not healthy"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(stop_timeout_s)
