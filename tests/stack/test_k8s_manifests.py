"""deploy/k8s proved without a cluster: the base and both overlays render with `kubectl kustomize` and
pass the Kubernetes schemas (strict); what the manifests promise is checked as rendered (internal
ports on loopback and in no Service, grpc.health.v1 probes, shared memory, secrets by reference, the
router's command); and the cpu overlay's replica pod runs as local processes from its own commands,
environment and probes (tests/k8s_local.py) and answers through its gateway what the in-process
engine answers."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
import yaml
from compose_local import start, stop
from k8s_local import K8S, find, localize_container, localize_pod, pod_ports, render, validate

from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.protos import nanokv_v1_pb2_grpc as pb_grpc
from nanokv.sampling import SamplingParams

PROMPT = "The capital of France is Paris. The capital of Italy is"
TARGETS = ["base", "overlays/cpu", "overlays/gpu"]
INTERNAL = {50061, 50062}  # the cache and compute services' gRPC ports: loopback only
KEY = "k8s-test-key"
SECRETS = {("nanokv-secrets", "api-keys"): KEY, ("nanokv-secrets", "valkey-password"): "valkey-pw"}


def _pod(docs, kind, name):
    return find(docs, kind, name)["spec"]["template"]["spec"]


def _by_name(pod):
    return {c["name"]: c for c in [*pod.get("initContainers", []), *pod["containers"]]}


@pytest.mark.parametrize("target", TARGETS)
def test_renders_and_validates(target):
    docs = render(target)
    validate(docs)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("StatefulSet", "nanokv-replica"), ("Service", "nanokv-replicas"), ("Deployment", "nanokv-router"),
            ("Service", "nanokv-router"), ("Deployment", "valkey"), ("Service", "valkey"),
            ("Deployment", "otel-collector"), ("Service", "otel-collector")} <= kinds
    # the collector runs the same configuration docker-compose.yml mounts
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("otel-collector"))
    assert yaml.safe_load(cm["data"]["config.yaml"]) == yaml.safe_load((K8S.parent / "otel-collector.yaml").read_text())
    mounted = _pod(docs, "Deployment", "otel-collector")["volumes"][0]["configMap"]["name"]
    assert mounted == cm["metadata"]["name"]  # the generated (hashed) name is what the pod mounts


@pytest.mark.parametrize("target", TARGETS)
def test_manifests_as_written(target):
    docs = render(target)
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    # every Service selects a workload, and exposes only named container ports of it, never an internal one
    for svc in (d for d in docs if d["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        pods = [w["spec"]["template"] for w in workloads if sel.items() <= w["spec"]["template"]["metadata"]
                ["labels"].items()]
        assert len(pods) == 1, svc["metadata"]["name"]
        named = {p["name"]: p["containerPort"] for c in _by_name(pods[0]["spec"]).values() for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in named and named[p["targetPort"]] not in INTERNAL, (svc["metadata"]["name"], p)
    replica = _pod(docs, "StatefulSet", "nanokv-replica")
    assert find(docs, "Service", "nanokv-replicas")["spec"]["clusterIP"] == "None"  # headless, for the router
    cs = _by_name(replica)
    assert list(cs) == ["cache", "compute", "gateway"]
    assert [c.get("restartPolicy") for c in replica["initContainers"]] == ["Always", "Always"]  # sidecars, in order
    # internal services bind loopback only and publish no container port for it
    assert cs["cache"]["args"][:2] == ["--listen", "127.0.0.1:50061"]
    assert cs["compute"]["args"][:4] == ["--listen", "127.0.0.1:50062", "--cache", "127.0.0.1:50061"]
    gw = cs["gateway"]["args"]
    assert gw[gw.index("--cache") + 1] == "127.0.0.1:50061" and gw[gw.index("--compute") + 1] == "127.0.0.1:50062"
    for c in cs.values():
        assert not {p["containerPort"] for p in c.get("ports", [])} & INTERNAL, c["name"]
    # probes: grpc.health.v1 everywhere (native grpc on the gateway's public port, `nanokv health` inside)
    for name, port in (("cache", 50061), ("compute", 50062)):
        for kind in ("startupProbe", "livenessProbe"):
            assert cs[name][kind]["exec"]["command"] == ["nanokv", "health", "-q", f"127.0.0.1:{port}"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert cs["gateway"][kind]["grpc"] == {"port": 50051}
    # the pool's shared memory: one memory-backed emptyDir at /dev/shm in cache and compute
    shm = [v for v in replica["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert len(shm) == 1
    for name in ("cache", "compute"):
        assert {"name": shm[0]["name"], "mountPath": "/dev/shm"} in cs[name]["volumeMounts"]
    # the router: the agreed command line; keys and the Valkey password only by Secret reference
    router = _by_name(_pod(docs, "Deployment", "nanokv-router"))["router"]
    assert router["command"] + router["args"] == [
        "nanokv", "router", "--host", "0.0.0.0", "--port", "8000", "--grpc-port", "50051",
        "--replicas-dns", "nanokv-replicas:8000:50051", "--routing", "kv"]
    for pod, container, var in ((replica, "gateway", "NANOKV_API_KEY"), (_pod(docs, "Deployment", "nanokv-router"),
                                "router", "NANOKV_API_KEY"), (_pod(docs, "Deployment", "valkey"), "valkey",
                                                              "VALKEY_PASSWORD")):
        env = {e["name"]: e for e in _by_name(pod)[container]["env"]}
        assert "secretKeyRef" in env[var]["valueFrom"], (container, var)
    assert not [d for d in docs if d["kind"] == "Secret"]  # no credential in the repository
    valkey = _by_name(_pod(docs, "Deployment", "valkey"))["valkey"]["args"]
    assert valkey[valkey.index("--requirepass") + 1] == "$(VALKEY_PASSWORD)"
    device = {n: cs[n]["args"][cs[n]["args"].index("--device") + 1] if "--device" in cs[n]["args"] else None
              for n in ("cache", "compute")}
    if target == "overlays/gpu":  # one GPU claim, shared by the two containers that meet over CUDA IPC
        assert device == {"cache": "cuda", "compute": "cuda"}
        assert replica["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "nanokv-gpu"}]
        for n in ("cache", "compute"):
            assert cs[n]["resources"]["claims"] == [{"name": "gpu"}]
        tmpl = find(docs, "ResourceClaimTemplate", "nanokv-gpu")["spec"]["spec"]["devices"]["requests"][0]
        assert tmpl["exactly"]["count"] == 1
    else:
        assert device == ({"cache": "cpu", "compute": "cpu"} if target == "overlays/cpu"
                          else {"cache": None, "compute": None})


def test_the_tls_component_turns_on_mutual_tls_with_probes_that_present_a_certificate():
    """overlays/cpu-tls = the cpu overlay + components/tls: it validates, the gateway requires client
    certificates, the router presents one, both read them from owner-only Secret volumes, and the
    gateway's probes are `nanokv health` over mutual TLS (a kubelet's grpc probe speaks no TLS;
    tests/router/test_router_tls.py runs that command against a real mutual-TLS gateway)."""
    docs = render("overlays/cpu-tls")
    validate(docs)
    plain = render("overlays/cpu")
    replica, router_pod = _pod(docs, "StatefulSet", "nanokv-replica"), _pod(docs, "Deployment", "nanokv-router")
    gw, router = _by_name(replica)["gateway"], _by_name(router_pod)["router"]
    files = {"--ssl-certfile": "/tls/tls.crt", "--ssl-keyfile": "/tls/tls.key", "--ssl-ca-certs": "/tls/ca.crt"}
    assert gw["args"] == _by_name(_pod(plain, "StatefulSet", "nanokv-replica"))["gateway"]["args"] + [
        x for kv in files.items() for x in kv]
    assert router["args"][-8:] == ["--replica-ssl-ca-certs", "/tls/ca.crt", "--replica-ssl-certfile", "/tls/tls.crt",
                                   "--replica-ssl-keyfile", "/tls/tls.key", "--replica-ssl-server-name",
                                   "nanokv-replicas"]
    for pod, c, secret in ((replica, gw, "nanokv-replica-tls"), (router_pod, router, "nanokv-router-tls")):
        assert {"name": "tls", "mountPath": "/tls", "readOnly": True} in c["volumeMounts"]
        vol = next(v for v in pod["volumes"] if v["name"] == "tls")
        assert vol["secret"] == {"secretName": secret, "defaultMode": 0o400}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = gw[kind]["exec"]["command"]
        assert cmd[:4] == ["nanokv", "health", "-q", "127.0.0.1:50051"] and "grpc" not in gw[kind]
        assert {cmd[i]: cmd[i + 1] for i in range(4, len(cmd), 2)} == {**files, "--ssl-server-name": "nanokv-replicas"}
    assert not [d for d in docs if d["kind"] == "Secret"]  # certificates by reference only


def test_cpu_replica_pod_runs_as_local_processes(tmp_path, llm):
    from otlp_receiver import Receiver

    docs = render("overlays/cpu")
    rx = Receiver()  # stands in for the collector Service
    hosts = {"otel-collector:4317": f"127.0.0.1:{rx.port}"}
    stack = localize_pod(_pod(docs, "StatefulSet", "nanokv-replica"), tmp_path / "replica-0", hosts, SECRETS,
                         prefix="replica-0-")
    # the router, from its Deployment: the headless Service's name resolves to this host (localhost,
    # through the same --replicas-dns lookup it makes in the cluster), at the replica gateway's ports
    gw = stack["replica-0-gateway"]
    router_pod = _pod(docs, "Deployment", "nanokv-router")
    router_c = _by_name(router_pod)["router"]
    router = localize_container(router_c, pod_ports(router_pod), tmp_path / "replica-0", hosts, SECRETS,
                                name="router", depends_on={"replica-0-gateway": "service_healthy"})
    i = router.argv.index("--replicas-dns")
    assert router.argv[i + 1].startswith("nanokv-replicas:")  # (its ports already remapped to local ones)
    router.argv[i + 1] = f"localhost:{gw.ports[8000]}:{gw.ports[50051]}"
    stack["router"] = router
    started = []
    try:
        started = start(stack, tmp_path / "replica-0")
        assert [s.name for s in started] == ["replica-0-cache", "replica-0-compute", "replica-0-gateway", "router"]
        ref = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
        body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        url = f"http://127.0.0.1:{gw.ports[8000]}/v1/completions"
        assert httpx.post(url, json=body, timeout=60).status_code == 401  # the Secret's key is required
        r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.text
        with grpc.insecure_channel(f"127.0.0.1:{gw.ports[50051]}") as ch:
            greedy = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            chunks = list(pb_grpc.GenerationStub(ch).Generate(
                pb.GenerateRequest(text=PROMPT, sampling_params=greedy), timeout=120,
                metadata=[("authorization", f"Bearer {KEY}")]))
            info = pb_grpc.GenerationStub(ch).GetServerInfo(pb.GetServerInfoRequest(), timeout=10,
                                                           metadata=[("authorization", f"Bearer {KEY}")])
        assert [t for c in chunks for t in c.token_ids] == list(ref.token_ids)
        # through the router: the same key, the same greedy text
        via = f"http://127.0.0.1:{router.ports[8000]}/v1/completions"
        assert httpx.post(via, json=body, timeout=60).status_code == 401
        deadline = time.monotonic() + 60  # the router lists the replica after its first health check
        while True:
            r = httpx.post(via, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.text
        assert info.kv_blocks_total == 2048  # the cpu overlay's --num-gpu-blocks
        pool = httpx.get(f"http://127.0.0.1:{stack['replica-0-cache'].ports[9101]}/metrics", timeout=10).text
        assert "nanokv_cache_pool_blocks 2048.0" in pool
        names = {"nanokv-cache", "nanokv-compute", "nanokv-gateway"}
        spans = rx.wait_for(lambda sp: names <= {s["service"] for s in sp}, 30)
        assert names <= {s["service"] for s in spans}
    finally:
        stop(started)
        rx.stop()
