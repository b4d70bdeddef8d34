"""The three services as processes, each serving /metrics on its own loopback port, for a Prometheus to
scrape (tests/stack/test_prometheus.py, trace_png): the cache and compute services on unix sockets in
`run_dir` with --metrics-port, the gateway (HTTP API, its /metrics) on the gateway job's port.
`nanokv up` and bench.stack cannot do this: they hand one config, so one metrics port, to both services."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from nanokv.launch import _die_with_parent, service_command
from nanokv.rpc import wait_serving

JOBS = ("nanokv-gateway", "nanokv-cache", "nanokv-compute")  # deploy/prometheus.yml's job names


class ScrapedStack:
    """Started and healthy (the gateway's /health answers 200) when the constructor returns; stop()
    ends all three. `ports`: job -> loopback port; `env`: the processes' environment (None: ours)."""

    def __init__(self, run_dir: Path, config: dict[str, Any], ports: dict[str, int],
                 env: dict[str, str] | None = None, timeout_s: float = 300.0):
        self.run_dir = run_dir
        self.cache, self.compute = f"unix:{run_dir / 'cache.sock'}", f"unix:{run_dir / 'compute.sock'}"
        self.base = f"http://127.0.0.1:{ports['nanokv-gateway']}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = env
        try:
            self._start("cache", service_command("cache", config, self.cache)
                        + ["--metrics-port", str(ports["nanokv-cache"])])
            wait_serving(self.cache, 120)
            self._start("compute", service_command("compute", config, self.compute, self.cache)
                        + ["--metrics-port", str(ports["nanokv-compute"])])
            self._start("gateway", [sys.executable, "-m", "nanokv.cli", "gateway", "--cache", self.cache,
                                    "--compute", self.compute, "--wait-s", str(timeout_s),
                                    "--port", str(ports["nanokv-gateway"]), "--grpc-port", "0",
                                    "--config-json", json.dumps(config)])
            deadline = time.monotonic() + timeout_s
            while not self._healthy():
                if time.monotonic() > deadline:
                    raise RuntimeError("the gateway did not become healthy")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, cmd: list[str]) -> None:
        with open(self.run_dir / f"{name}.log", "wb") as out:
            self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                env=self.env,
                                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def log(self, name: str, n: int = 3000) -> str:
        return (self.run_dir / f"{name}.log").read_text(errors="replace")[-n:]

    def _healthy(self) -> bool:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.log(name)}")
        try:
            return httpx.get(f"{self.base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop_one(self, name: str, timeout_s: float = 30.0) -> None:
        p = self.procs.get(name)
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop(self) -> None:
        for name in ("gateway", "compute", "cache"):  # compute before cache: it detaches from the pool first
            self.stop_one(name)
