"""Debian's Prometheus server (`apt-get install prometheus`) as a child process, and its HTTP API.

The configuration is the compose stack's deploy/prometheus.yml with its job names and rule files
kept and only what cannot hold outside containers changed: each job's target becomes a local
address, and the intervals shrink so a run of seconds has samples to rate. The server keeps its
data in a private temporary folder and listens on loopback only.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

import nanokv

REPO = Path(nanokv.__file__).resolve().parent.parent
DEPLOY_CONFIG = REPO / "deploy" / "prometheus.yml"
ALERTS = Path(nanokv.__file__).resolve().parent / "ops" / "alerts.yml"
BOARD = Path(nanokv.__file__).resolve().parent / "ops" / "grafana.json"


def binary() -> str | None:
    return shutil.which("prometheus")


def local_config(targets: dict[str, str], interval_s: float = 1.0) -> dict[str, Any]:
    """deploy/prometheus.yml with job -> "127.0.0.1:port" for every job it scrapes (all must be given),
    nanokv/ops/alerts.yml as the rule file, scrapes and rule evaluations every `interval_s`."""
    cfg = yaml.safe_load(DEPLOY_CONFIG.read_text())
    jobs = [j["job_name"] for j in cfg["scrape_configs"]]
    if sorted(jobs) != sorted(targets):
        raise ValueError(f"targets: deploy/prometheus.yml scrapes {jobs}, got addresses for {sorted(targets)}")
    every = f"{int(interval_s * 1000)}ms"
    cfg["global"] = {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every}
    cfg["rule_files"] = [str(ALERTS)]
    for job in cfg["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    return cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """`prometheus` running `config`; ready (GET /-/ready answers 200) when the constructor returns."""

    def __init__(self, config: dict[str, Any], exe: str | None = None, timeout_s: float = 60.0):
        exe = exe or binary()
        if exe is None:
            raise FileNotFoundError("prometheus: not installed (Debian/Ubuntu: apt-get install -y prometheus)")
        self.dir = Path(tempfile.mkdtemp(prefix="nanokv-prometheus-"))
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = self.dir / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [exe, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not become ready:\n{self.log_tail()}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _get(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant vector result of `expr` (a scalar comes back as one unlabelled sample)."""
        data = self._get("query", query=expr, **({"time": at} if at is not None else {}))
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return list(self._get("query_range", query=expr, start=start, end=end, step=step)["result"])

    def rules(self) -> list[dict[str, Any]]:
        return [r for g in self._get("rules")["groups"] for r in g["rules"]]

    def alerts(self) -> list[dict[str, Any]]:
        return list(self._get("alerts")["alerts"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
