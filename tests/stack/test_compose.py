"""docker-compose.yml proved without images: its CPU profile's nanokv services run as local processes
from the file's own commands, environment and health checks (tests/compose_local.py), and answer
through the gateway's gRPC and HTTP APIs what the in-process engine answers; the rest of the file
(GPU profile, publishing, observability mounts) and the Dockerfile's stages are checked as written;
`docker compose config` validates both profiles where the compose plugin is installed."""

from __future__ import annotations

import re
import shutil
import subprocess

import grpc
import httpx
import pytest
import yaml
from compose_local import ROOT, dotenv, load_compose, localize, services_of, start, stop

from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.protos import nanokv_v1_pb2_grpc as pb_grpc
from nanokv.sampling import SamplingParams

PROMPT = "The capital of France is Paris. The capital of Italy is"
NANOKV = ("cache", "compute", "gateway")


def test_cpu_profile_runs_as_local_processes(tmp_path, llm):
    from otlp_receiver import Receiver

    compose = load_compose()
    env = dotenv()
    assert "cpu" in env["COMPOSE_PROFILES"].split(",")  # `docker compose up` runs the cpu profile
    specs = services_of(compose, "cpu")
    assert sorted(specs) == ["cache-cpu", "compute-cpu", "gateway"]
    rx = Receiver()  # stands in for the collector: the services' OTEL_* point there
    hosts = {"otel-collector:4317": f"127.0.0.1:{rx.port}"}
    stack = {n: localize(n, s, env, tmp_path, hosts, list(compose["services"])) for n, s in specs.items()}
    started = []
    try:
        started = start(stack, tmp_path)
        assert started.index(stack["compute-cpu"]) > started.index(stack["cache-cpu"])  # depends_on: healthy
        gw = stack["gateway"]
        ref = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
        with grpc.insecure_channel(f"127.0.0.1:{gw.ports[50051]}") as ch:
            stub = pb_grpc.GenerationStub(ch)
            greedy = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            chunks = list(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=greedy), timeout=120))
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        ids = [t for c in chunks for t in c.token_ids]
        assert ids == list(ref.token_ids)  # token for token what the in-process engine answers
        assert chunks[-1].finished and chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
        assert info.kv_blocks_total == 2048  # the compose file's --num-gpu-blocks sized the pool
        body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(f"http://127.0.0.1:{gw.ports[8000]}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.text
        assert httpx.get(f"http://127.0.0.1:{gw.ports[8000]}/metrics", timeout=10).status_code == 200
        # the cache and compute services' own /metrics (--metrics-port, the port prometheus scrapes)
        pool = httpx.get(f"http://127.0.0.1:{stack['cache-cpu'].ports[9100]}/metrics", timeout=10).text
        assert "nanokv_cache_pool_blocks 2048.0" in pool, pool[-2000:]
        steps = httpx.get(f"http://127.0.0.1:{stack['compute-cpu'].ports[9100]}/metrics", timeout=10).text
        assert 'method="Step"' in steps
        # the x-otel environment took effect: each process exports under its compose OTEL_SERVICE_NAME
        names = {s["environment"]["OTEL_SERVICE_NAME"] for s in specs.values()}
        spans = rx.wait_for(lambda sp: names <= {s["service"] for s in sp}, 30)
        assert names <= {s["service"] for s in spans}, {s["service"] for s in spans}
    finally:
        stop(started)
        rx.stop()
    assert all(s.proc is not None and s.proc.returncode is not None for s in started)


def _stage(dockerfile: str, name: str) -> tuple[str, str]:
    """(base, instructions with continuations joined) of a multi-stage Dockerfile's stage `name`."""
    text = re.sub(r"\\\n\s*", " ", dockerfile)
    stages = re.split(r"^FROM\s+", text, flags=re.M)[1:]
    for st in stages:
        head, _, body = st.partition("\n")
        base, _, alias = head.partition(" AS ")
        if alias.strip() == name:
            return base.strip(), body
    raise AssertionError(f"no stage {name}")


def test_compose_file_as_written():
    compose = load_compose()
    svc = compose["services"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    # the gateway image: built from a stage that installs no torch, and proves it at build time
    assert svc["gateway"]["build"]["target"] == "gateway"
    base, body = _stage(dockerfile, "gateway")
    assert base != "services" and _stage(dockerfile, base)[0] == "python:3.11-slim"
    installs = re.findall(r"pip install[^&]*", body)
    assert installs and not any("torch" in ln for ln in installs), installs
    # the base install is the gateway (torch only in the services extra): no hand-kept dependency list
    assert "pip install --no-cache-dir ." in body and "--no-deps ." not in body
    assert '".[services]"' in _stage(dockerfile, "services")[1]
    assert "find_spec('torch') is not None" in body
    assert "torch" in _stage(dockerfile, "services")[1]
    for n in ("cache-cpu", "compute-cpu", "cache", "compute"):
        assert svc[n]["build"]["target"] == "services"
    # the pool is shared memory (CPU) or CUDA IPC (GPU): one IPC namespace, a GPU each on the gpu profile
    assert svc["cache-cpu"]["ipc"] == "shareable" and svc["compute-cpu"]["ipc"] == "service:cache-cpu"
    for n in ("cache", "compute"):
        assert svc[n]["profiles"] == ["gpu"] and svc[n]["ipc"] == "host"
        devices = svc[n]["deploy"]["resources"]["reservations"]["devices"]
        assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert "cuda" in " ".join(svc[n]["command"])
    for n in ("cache-cpu", "compute-cpu"):
        assert "deploy" not in svc[n] and svc[n]["profiles"] == ["cpu"]
    # only loopback ports are published, and never the internal services'
    for n, s in svc.items():
        for p in s.get("ports", []):
            assert str(p).startswith("127.0.0.1:"), (n, p)
        if n.startswith(("cache", "compute", "otel-collector")):
            assert "ports" not in s, n
    # a grpc.health.v1 (nanokv health) check on every nanokv service
    for n in ("cache-cpu", "compute-cpu", "cache", "compute", "gateway"):
        assert svc[n]["healthcheck"]["test"][:3] == ["CMD", "nanokv", "health"], n
    # prometheus loads the alert rules from where prometheus.yml says, and scrapes the gateway's port
    prom = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    mounts = dict(v.split(":")[1::-1] for v in svc["prometheus"]["volumes"])  # container path -> source
    assert mounts[prom["rule_files"][0]] == "./nanokv/ops/alerts.yml" and (ROOT / "nanokv/ops/alerts.yml").exists()
    assert mounts["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus.yml"
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == ["gateway:8000"]
    assert "--port" in svc["gateway"]["command"] and "8000" in svc["gateway"]["command"]
    # grafana: the provider's folder holds the board; the data source reaches prometheus
    graf = dict(v.split(":")[1::-1] for v in svc["grafana"]["volumes"])
    prov = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/nanokv.yaml").read_text())
    board_dir = prov["providers"][0]["options"]["path"]
    assert graf[f"{board_dir}/nanokv.json"] == "./nanokv/ops/grafana.json"
    assert graf["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/nanokv.yaml").read_text())
    assert {d["url"] for d in ds["datasources"]} == {"http://prometheus:9090", "http://jaeger:16686"}
    # traces: every nanokv service exports to the collector, which forwards to jaeger
    col = yaml.safe_load((ROOT / "deploy/otel-collector.yaml").read_text())
    assert col["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert svc["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for n in ("cache-cpu", "compute-cpu", "cache", "compute", "gateway"):
        assert svc[n]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317", n


def _compose_cli() -> list[str] | None:
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) and subprocess.run([*cmd, "version"], capture_output=True).returncode == 0:
            return cmd
    return None


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_docker_compose_config(profile):
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no compose CLI (`docker compose` plugin or docker-compose): sh deploy/install-compose-plugin.sh")
    r = subprocess.run([*cli, "--profile", profile, "config", "-q"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*cli, "--profile", profile, "config", "--services"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    names = set(r.stdout.split())
    assert {"gateway", "otel-collector", "jaeger", "prometheus", "grafana"} <= names
    assert ({"cache-cpu", "compute-cpu"} if profile == "cpu" else {"cache", "compute"}) <= names
