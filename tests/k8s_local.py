"""deploy/k8s rendered with `kubectl kustomize`, checked against the Kubernetes schemas offline
(the kubernetes-validate package), and a pod's containers run as local processes on loopback with
tests/compose_local.py's machinery (tests/stack/test_k8s_manifests.py).

`localize_pod` keeps each container's command, args and environment and changes only what cannot hold
outside a cluster, as compose_local.localize does: container ports (and loopback ports named in the
arguments) become free local ports, shared by the pod's containers as their network namespace is;
other Services' "name:port" become the local addresses in `hosts`; secretKeyRef values come from
`secrets`; emptyDir mounts become folders of the run dir (/dev/shm stays the host's, which is what
the pod's memory-backed /dev/shm is to its containers). Start order and readiness are the kubelet's:
native sidecars (init containers with restartPolicy Always) one after the other, each once the
previous one's startupProbe passed, then the main containers; a probe is run as the kubelet would
(exec: its command; grpc: a grpc.health.v1 Check of that port, i.e. `nanokv health`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from compose_local import ROOT, Local, free_port, translate

K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.34"  # the schemas checked against: native sidecars, DRA resource.k8s.io/v1
_VAR = re.compile(r"\$\((\w+)\)|\$\$\((\w+)\)")
_LOOPBACK_PORT = re.compile(r"\b127\.0\.0\.1:(\d+)\b")


def require_kubectl() -> str:
    exe = shutil.which("kubectl")
    if exe is None:
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail("kubectl is not installed; under CI it must be (it renders deploy/k8s)")
        pytest.skip("kubectl is not installed (it renders deploy/k8s with its built-in kustomize)")
    return exe


def render(target: str) -> list[dict[str, Any]]:
    """`kubectl kustomize deploy/k8s/<target>` as a list of objects."""
    r = subprocess.run([require_kubectl(), "kustomize", str(K8S / target)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def validate(docs: list[dict[str, Any]]) -> None:
    """Every object against the Kubernetes OpenAPI schema (strict: unknown fields are errors)."""
    import kubernetes_validate

    for d in docs:
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{d['kind']}/{d['metadata']['name']}: {e.message} at {list(e.path)}") from None


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    got = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(got) == 1, f"{kind}/{name}: {len(got)} objects"
    return got[0]


def containers_in_order(pod: dict[str, Any]) -> list[tuple[dict[str, Any], bool]]:
    """(container, is_sidecar) in the kubelet's start order; plain init containers are not used here."""
    init = pod.get("initContainers", [])
    assert all(c.get("restartPolicy") == "Always" for c in init), "only native sidecars among initContainers"
    return [(c, True) for c in init] + [(c, False) for c in pod["containers"]]


def _expand(s: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) from the container's env ($$(VAR) stays literal; unknown names too)."""
    def sub(m: re.Match[str]) -> str:
        if m.group(2) is not None:
            return f"$({m.group(2)})"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(sub, s)


def _probe(c: dict[str, Any]) -> list[str]:
    probe = c.get("startupProbe") or c.get("readinessProbe")
    assert probe, f"{c['name']}: no startup or readiness probe"
    if "exec" in probe:
        return [str(a) for a in probe["exec"]["command"]]
    assert "grpc" in probe, f"{c['name']}: probe {probe} is neither exec nor grpc"
    port = probe["grpc"]["port"]
    named = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    port = named[port] if isinstance(port, str) else port
    return ["nanokv", "health", "-q", f"127.0.0.1:{port}"]  # what the kubelet's grpc probe asks


def pod_ports(pod: dict[str, Any]) -> dict[int, int]:
    """Every port of the pod's network namespace -> a free local port."""
    found: set[int] = set()
    for c, _ in containers_in_order(pod):
        found.update(p["containerPort"] for p in c.get("ports", []))
        for a in [*c.get("args", []), *c.get("command", []), *_probe(c)]:
            found.update(int(p) for p in _LOOPBACK_PORT.findall(str(a)))
    return {p: free_port() for p in sorted(found)}


def localize_container(c: dict[str, Any], ports: dict[int, int], run_dir: Path, hosts: dict[str, str],
                       secrets: dict[tuple[str, str], str], name: str | None = None,
                       depends_on: dict[str, str] | None = None) -> Local:
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = _expand(str(e["value"]), env)
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[(ref["name"], ref["key"])]
    mounts = {}
    for m in c.get("volumeMounts", []):
        if m["mountPath"] != "/dev/shm":
            (run_dir / m["name"]).mkdir(exist_ok=True)
            mounts[m["mountPath"]] = str(run_dir / m["name"])

    def cmd(words: list[Any]) -> list[str]:
        out = [translate(_expand(str(w), env), mounts, hosts, ports) for w in words]
        assert out[0] == "nanokv", f"{c['name']}: runs {out[0]!r}, not the image's nanokv"
        return [str(Path(sys.executable).with_name("nanokv")), *out[1:]]

    argv = cmd([*c["command"], *c.get("args", [])])
    penv = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NANOKV_"))}
    penv.update({k: translate(v, mounts, hosts, ports) for k, v in env.items()})
    return Local(name or c["name"], argv, penv, cmd(_probe(c)), ports, depends_on or {})


def localize_pod(pod: dict[str, Any], run_dir: Path, hosts: dict[str, str], secrets: dict[tuple[str, str], str],
                 prefix: str = "") -> dict[str, Local]:
    """The pod's containers as Locals named prefix + container name, ordered by depends_on as the
    kubelet orders them (each sidecar after the previous one's startupProbe; then the containers)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ports = pod_ports(pod)
    out: dict[str, Local] = {}
    last_sidecar = None
    for c, sidecar in containers_in_order(pod):
        deps = {last_sidecar: "service_healthy"} if last_sidecar else {}
        loc = localize_container(c, ports, run_dir, hosts, secrets, prefix + c["name"], deps)
        out[loc.name] = loc
        if sidecar:
            last_sidecar = loc.name
    return out
