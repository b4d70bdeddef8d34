"""Run docker-compose.yml's nanokv services as local processes on loopback (tests/stack/test_compose.py).

Each service's `entrypoint` + `command` runs with its `environment` (${VAR:-default} resolved from
.env, as compose does), in the order `depends_on` gives, waiting for its `healthcheck` command to
exit 0 where a dependent asks for service_healthy. `localize` is the only place where anything is
changed from the file, and it changes only what cannot hold outside containers (see there).
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
_VAR = re.compile(r"\$\{(\w+)(?:(:?)-([^}]*))?\}")


def load_compose() -> dict[str, Any]:
    with open(ROOT / "docker-compose.yml") as f:
        return yaml.safe_load(f)  # YAML merge keys (<<: *otel) are resolved by the loader


def dotenv() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (ROOT / ".env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} (unset or empty) and ${VAR-default} (unset only)."""
    def sub(m: re.Match) -> str:
        name, colon, default = m.group(1), m.group(2), m.group(3)
        if default is None:
            return env.get(name, "")
        got = env.get(name)
        return default if got is None or (colon and got == "") else got
    return _VAR.sub(sub, value).replace("$$", "$")


def services_of(compose: dict[str, Any], profile: str) -> dict[str, dict[str, Any]]:
    """The nanokv services (built from this repository) that `profile` starts."""
    return {name: spec for name, spec in compose["services"].items()
            if "build" in spec and (not spec.get("profiles") or profile in spec["profiles"])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Local:
    name: str
    argv: list[str]
    env: dict[str, str]
    health: list[str]
    ports: dict[int, int]  # container port -> local loopback port
    depends_on: dict[str, str] = field(default_factory=dict)  # service -> condition
    proc: subprocess.Popen | None = None


def translate(s: str, mounts: dict[str, str], hosts: dict[str, str], ports: dict[int, int]) -> str:
    """One argument or environment value moved out of containers: mount paths -> local folders,
    "name:port" of other containers -> local addresses, container ports -> local ports, a 0.0.0.0
    bind -> 127.0.0.1 (tests/k8s_local.py uses it for Kubernetes pods too)."""
    for dst, local in mounts.items():
        s = re.sub(rf"(?<![\w/]){re.escape(dst)}(?=/|$)", local, s)
    for dns, local in hosts.items():
        s = s.replace(dns, local)
    for container, local_port in ports.items():
        s = str(local_port) if s == str(container) else re.sub(rf"(?<=:){container}\b", str(local_port), s)
    return "127.0.0.1" if s == "0.0.0.0" else s


def localize(name: str, spec: dict[str, Any], env: dict[str, str], run_dir: Path, hosts: dict[str, str],
             service_names: list[str]) -> Local:
    """Translate one compose service to a local process. The only changes:
    - named volumes (the unix-socket volume) become folders of `run_dir`, in every argument;
    - each published or exposed container port becomes a free loopback port (the argument naming it too);
    - other services' DNS names "name:port" become the local addresses in `hosts` (the collector:
      the test's OTLP receiver), and a 0.0.0.0 bind becomes 127.0.0.1;
    - the image's `nanokv` console script is the one installed next to this Python.
    Any "name:port" of a compose service (`service_names`) left after that is an error."""
    mounts = {}
    for v in spec.get("volumes", []):
        src, dst = v.split(":")[:2]
        if not src.startswith((".", "/")):  # a named volume: shared between the services like the real one
            (run_dir / src).mkdir(exist_ok=True)
            mounts[dst] = str(run_dir / src)
    ports = {}
    for p in spec.get("ports", []):
        host_ip, _, container = str(p).rsplit(":", 2)
        assert host_ip == "127.0.0.1", f"{name}: port {p} published beyond loopback"
        ports[int(container)] = free_port()
    for p in spec.get("expose", []):  # reached by other containers only (metrics): its own free port here too
        ports.setdefault(int(p), free_port())

    def rewrite(s: str) -> str:
        return translate(interpolate(str(s), env), mounts, hosts, ports)

    def command(value: Any) -> list[str]:
        return shlex.split(value) if isinstance(value, str) else [str(x) for x in (value or [])]

    argv = [rewrite(a) for a in command(spec.get("entrypoint")) + command(spec.get("command"))]
    test = command(spec.get("healthcheck", {}).get("test"))
    assert test and test[0] == "CMD", f"{name}: healthcheck.test must be [CMD, ...], got {test}"
    health = [rewrite(a) for a in test[1:]]
    for cmd in (argv, health):
        assert cmd[0] == "nanokv", f"{name}: runs {cmd[0]!r}, not the image's nanokv"
        cmd[0] = str(Path(sys.executable).with_name("nanokv"))
    environment = spec.get("environment", {})
    if isinstance(environment, list):
        environment = dict(e.split("=", 1) for e in environment)
    penv = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NANOKV_"))}
    penv.update({k: rewrite(v) for k, v in environment.items()})
    deps = spec.get("depends_on", {})
    if isinstance(deps, list):
        deps = {d: {"condition": "service_started"} for d in deps}
    deps = {d: c["condition"] for d, c in deps.items()}
    local = Local(name, argv, penv, health, ports, deps)
    others = "|".join(re.escape(n) for n in service_names)
    left = [a for a in [*argv, *health, *(penv[k] for k in environment)] if re.search(rf"(?<![\w.-])({others}):\d", a)]
    assert not left, f"{name}: untranslated service addresses {left}"
    return local


def wait_healthy(svc: Local, started: list[Local], timeout_s: float, run_dir: Path) -> None:
    """Run the service's compose healthcheck command until it exits 0 (as docker would); fail at
    once when any started service has exited (docker would not restart it either)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for s in started:
            assert s.proc is not None
            if s.proc.poll() is not None:
                log = (run_dir / f"{s.name}.log").read_text()[-3000:]
                raise AssertionError(f"{s.name} exited with {s.proc.returncode}:\n{log}")
        rc = subprocess.run(svc.health, env=svc.env, capture_output=True, timeout=30).returncode
        if rc == 0:
            return
        if time.monotonic() > deadline:
            log = (run_dir / f"{svc.name}.log").read_text()[-3000:]
            raise AssertionError(f"{svc.name}: healthcheck {svc.health} still exits {rc}\n{log}")
        time.sleep(0.5)


def start(locals_: dict[str, Local], run_dir: Path, timeout_s: float = 300) -> list[Local]:
    """Start in depends_on order; a service_healthy dependency is healthy before its dependent starts.
    Returns the services in start order, all healthy (stop them in reverse); on failure stops them."""
    started: list[Local] = []
    healthy: set[str] = set()
    pending = dict(locals_)
    try:
        while pending:
            ready = [s for s in pending.values() if all(d in {x.name for x in started} for d in s.depends_on)]
            assert ready, f"depends_on cycle or unknown service among {list(pending)}"
            for s in ready:
                for d, cond in s.depends_on.items():
                    if cond == "service_healthy" and d not in healthy:
                        wait_healthy(locals_[d], started, timeout_s, run_dir)
                        healthy.add(d)
                out = open(run_dir / f"{s.name}.log", "wb")  # noqa: SIM115 - the child keeps it
                s.proc = subprocess.Popen(s.argv, env=s.env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, cwd=run_dir)
                out.close()
                started.append(s)
                del pending[s.name]
        for s in started:
            if s.name not in healthy:
                wait_healthy(s, started, timeout_s, run_dir)
    except BaseException:
        stop(started)
        raise
    return started


def stop(started: list[Local]) -> None:
    for s in reversed(started):
        if s.proc is not None and s.proc.poll() is None:
            s.proc.terminate()
            try:
                s.proc.wait(30)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()
