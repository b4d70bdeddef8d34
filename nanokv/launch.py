"""The services as local processes: `nanokv up` (cache, compute and gateway, kept running by
nanokv.supervise) and `start_services` (cache and compute for `nanokv generate --split` and tests).

Cache and compute get the same EngineConfig (as --config-json) and listen on unix sockets in a run
directory; they count as started once they answer grpc.health.v1 with SERVING (the compute service
after loading the model and attaching to the cache service's pool). Under `nanokv up` the gateway
gets the command line `up` got (without --run-dir) and counts as started once /health answers 200.
No torch here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from nanokv.rpc import wait_serving
from nanokv.supervise import Backoff, Child, StartFailed, Supervisor

START_TIMEOUT_S = 600.0  # loading a large model on a busy machine
log = logging.getLogger("nanokv.up")


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


# ---- nanokv up ------------------------------------------------------------------------------------
def up_main(args: argparse.Namespace, argv: list[str]) -> int:
    """`nanokv up`: every service gets the whole config as --config-json (each takes its own keys);
    the gateway also gets up's server flags (host, ports, API keys, limits)."""
    from nanokv.config import EngineConfig
    from nanokv.flags import engine_kwargs
    from nanokv.tls import server_tls

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = EngineConfig.from_kwargs(**engine_kwargs(args)).to_dict()
    tls = server_tls(args)  # a bad certificate or key is refused here, before any service starts
    try:
        return up(config, server_argv(args) + ["--config-json", json.dumps(config)], args.host, args.port,
                  args.run_dir, tls=tls is not None)
    except StartFailed as e:
        print(f"nanokv up: error: {e}", file=sys.stderr)
        return 1


SERVER_FLAGS = ("host", "port", "grpc_port", "served_model_name", "max_waiting", "max_body_bytes", "log_level",
                "ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "ssl_cert_reqs")


def server_argv(args: argparse.Namespace) -> list[str]:
    """The gateway's server flags (nanokv.gateway.http.cli.add_serve_args) as `up` was given them."""
    out: list[str] = []
    for name in SERVER_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            out += ["--" + name.replace("_", "-"), str(value)]
    for key in getattr(args, "api_key", None) or []:
        out += ["--api-key", key]
    return out


def up(config: dict[str, Any], gateway_argv: list[str], host: str, port: int, run_dir: str | None = None,
       backoff: Backoff | None = None, tls: bool = False) -> int:
    """Start cache, compute and gateway in that order, restart whichever exits, stop all on SIGTERM or
    SIGINT (nanokv.supervise); a temporary run dir (run_dir None) is removed at the end. With `tls` the
    gateway serves HTTPS (its --ssl-* flags are in gateway_argv): it counts as started once its port
    accepts connections (the server binds it after start-up; a probe may hold no client certificate)."""
    own = run_dir is None
    run_dir = run_dir or tempfile.mkdtemp(prefix="nanokv-")
    os.makedirs(run_dir, exist_ok=True)
    cache, compute = (f"unix:{os.path.join(run_dir, k)}.sock" for k in ("cache", "compute"))
    probe = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    health = f"http://[{probe}]:{port}/health" if ":" in probe else f"http://{probe}:{port}/health"
    gateway_up = (lambda: _listening(probe, port)) if tls else (lambda: _http_ok(health))
    gateway = [sys.executable, "-m", "nanokv.cli", "gateway", "--cache", cache, "--compute", compute,
               "--wait-s", str(START_TIMEOUT_S), *gateway_argv]
    sup = Supervisor([
        Child("cache", service_command("cache", config, cache), os.path.join(run_dir, "cache.log"),
              started=lambda: _serving(cache)),
        Child("compute", service_command("compute", config, compute, cache), os.path.join(run_dir, "compute.log"),
              started=lambda: _serving(compute)),
        Child("gateway", gateway, None, started=gateway_up),  # its log: up's own output
    ], run_dir, backoff, start_timeout_s=START_TIMEOUT_S)
    sup.install_signal_handlers()
    try:
        if not sup.start_all():
            return 0
        pids = ", ".join(f"{c.name} pid {c.proc.pid}" for c in sup.children if c.proc is not None)
        log.info("up: %s; gateway on %s://%s:%d; run dir %s (pids.json, cache.log, compute.log)",
                 pids, "https" if tls else "http", host, port, run_dir)
        return sup.run()
    finally:
        sup.stop_all()  # a no-op unless something above raised
        remove_segments(sup.child("cache").pids)
        if own:
            shutil.rmtree(run_dir, ignore_errors=True)


def remove_segments(owners: list[int]) -> list[str]:
    """The KV segments in shared memory of these (stopped) cache service processes: a SIGKILLed one
    leaves its segment, which the next cache service removes at start, but not if none comes."""
    from nanokv.cache_service.segments import PREFIX, shm_dir

    d, removed = shm_dir(), []
    prefixes = tuple(f"{PREFIX}{pid}-" for pid in owners)
    for name in os.listdir(d) if prefixes else ():
        if name.startswith(prefixes):
            try:
                os.unlink(os.path.join(d, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def _serving(address: str) -> bool:
    try:
        wait_serving(address, 0.5)
        return True
    except TimeoutError:
        return False


def _listening(host: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((host, port), timeout=2.0).close()
        return True
    except OSError:
        return False


def _http_ok(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2.0) as r:
            return int(r.status) == 200
    except (OSError, ValueError, urllib.error.HTTPError):
        return False
