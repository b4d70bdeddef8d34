"""docker-compose.yml's `replicas` profile as written: two CPU replicas (cache, compute, gateway each,
as the cpu profile runs them, on their own socket volume and IPC namespace), the router in front of
them (the only published ports), and Valkey; `docker compose config` validates it where the CLI is
installed. The replicas' commands are the cpu profile's, which tests/stack/test_compose.py runs."""

from __future__ import annotations

import subprocess

import pytest
from compose_local import ROOT, load_compose, services_of
from test_compose import _compose_cli

REPLICAS = [f"replica-{i}-{kind}" for i in (1, 2) for kind in ("cache", "compute", "gateway")]


def _profile(compose, name):
    return {n: s for n, s in compose["services"].items() if name in s.get("profiles", [])}


def test_replicas_profile_as_written():
    compose = load_compose()
    svc = compose["services"]
    assert sorted(_profile(compose, "replicas")) == sorted([*REPLICAS, "router", "valkey"])
    # the single-replica stack stays out of the replicas profile (both publish 8000/50051)
    assert "replica-1-gateway" not in services_of(compose, "cpu") and "gateway" not in _profile(compose, "replicas")
    for i in (1, 2):
        cache, compute, gw = (svc[f"replica-{i}-{k}"] for k in ("cache", "compute", "gateway"))
        vol = f"replica-{i}-run:/run/nanokv"
        assert cache["volumes"] == compute["volumes"] == gw["volumes"] == [vol]
        assert cache["ipc"] == "shareable" and compute["ipc"] == f"service:replica-{i}-cache"
        assert compute["depends_on"] == {f"replica-{i}-cache": {"condition": "service_healthy"}}
        # the cpu profile's commands, unchanged
        assert cache["command"] == svc["cache-cpu"]["command"] and compute["command"] == svc["compute-cpu"]["command"]
        assert gw["command"] == svc["gateway"]["command"]
        assert "ports" not in gw and gw["networks"]["default"]["aliases"] == ["replicas"]
        assert gw["environment"]["NANOKV_API_KEY"] == "${NANOKV_API_KEY:-}"
        for s in (cache, compute, gw):
            assert s["healthcheck"]["test"][:3] == ["CMD", "nanokv", "health"]
    assert set(compose["volumes"]) >= {"replica-1-run", "replica-2-run"}
    router = svc["router"]
    assert router["command"] == ["nanokv", "router", "--host", "0.0.0.0", "--port", "8000", "--grpc-port", "50051",
                                 "--replicas-dns", "replicas:8000:50051", "--routing", "kv"]
    assert router["ports"] == ["127.0.0.1:8000:8000", "127.0.0.1:50051:50051"]
    assert set(router["depends_on"]) == {"replica-1-gateway", "replica-2-gateway"}
    valkey = svc["valkey"]
    assert "ports" not in valkey and valkey["command"][:2] == ["valkey-server", "--requirepass"]
    assert valkey["command"][2].startswith("${VALKEY_PASSWORD")


def test_docker_compose_config_replicas():
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no compose CLI (`docker compose` plugin or docker-compose): sh deploy/install-compose-plugin.sh")
    r = subprocess.run([*cli, "--profile", "replicas", "config", "--services"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert {*REPLICAS, "router", "valkey", "otel-collector"} <= set(r.stdout.split())
    assert "gateway" not in r.stdout.split()
