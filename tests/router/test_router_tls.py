"""`nanokv router` to a replica over mutual TLS (real processes: one `nanokv serve` that requires a
client certificate on its HTTP and gRPC ports, routers in front of it), with certificates made by
the test (tests/helpers_tls.py).

A router holding the CA and a client certificate answers through it, on its own TLS ports, with the
replica's greedy tokens and the caller's API key carried through; a router without a client
certificate sees the replica refused, reports it unhealthy and answers callers at once with a status
that says why; a client without the right certificate is refused by the gateway itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nanokv.errors import ConfigError
from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.protos import nanokv_v1_pb2_grpc as pb_grpc
from nanokv.tls import ClientTLS, ServerTLS
from tests.helpers_grpc import KEY_A, KEY_B, ROOT, _stop, auth, free_port
from tests.helpers_tls import CA, Pair
from tests.router.helpers_router import MODEL, REPLICA_FLAGS, chat

ROUTER_ONLY_KEY = "router-only-key"  # the router accepts it, the replica does not
# the replica's certificate names it, not its address: the router dials 127.0.0.1 and checks this name
# (--replica-ssl-server-name), as one behind --replicas-dns dials each pod's address
REPLICA_NAME = "nanokv-replicas.test"
PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]


@dataclass
class Proc:
    proc: subprocess.Popen
    http: str
    grpc_address: str
    log: Path

    def stop(self) -> None:
        _stop(self.proc)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Certs:
    ca: CA
    replica: Pair
    router: Pair  # the router's public side (server) and its client certificate to the replica
    stranger: Pair  # a client certificate another CA signed

    def creds(self, client: Pair | None = None) -> grpc.ChannelCredentials:
        key = client.key.read_bytes() if client else None
        chain = client.cert.read_bytes() if client else None
        return grpc.ssl_channel_credentials(self.ca.cert.read_bytes(), key, chain)

    def to_replica(self, replica: Proc, client: Pair | None = None) -> grpc.Channel:
        return grpc.secure_channel(replica.grpc_address, self.creds(client),
                                   options=[("grpc.ssl_target_name_override", REPLICA_NAME)])

    def https(self, client: Pair | None = None) -> httpx.Client:
        cfg = ClientTLS(str(self.ca.cert), str(client.cert) if client else None, str(client.key) if client else None)
        return httpx.Client(verify=cfg.ssl_context(), timeout=120)


SNI = {"sni_hostname": REPLICA_NAME}  # httpx: the name an https request to the replica checks


def spawn(args: list[str], name: str) -> tuple[subprocess.Popen, Path]:
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"nanokv-tls-{name}-{os.getpid()}.log"
    out = open(log, "wb")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen([sys.executable, "-m", "nanokv.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                            cwd=ROOT, stdin=subprocess.DEVNULL)
    out.close()
    return proc, log


def wait_for(p: Proc, ready, what: str, timeout_s: float = 300) -> Proc:
    deadline = time.monotonic() + timeout_s
    while True:
        if p.proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {p.proc.returncode}:\n{p.text()[-3000:]}")
        try:
            if ready():
                return p
        except (grpc.RpcError, httpx.HTTPError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready in {timeout_s:.0f} s:\n{p.text()[-3000:]}")
        time.sleep(0.3)


def start_replica(c: Certs) -> Proc:
    http_port, grpc_port = free_port(), free_port()
    proc, log = spawn(["serve", "--port", str(http_port), "--grpc-port", str(grpc_port), "--api-key", KEY_A,
                       "--api-key", KEY_B, "--log-level", "warning", *REPLICA_FLAGS, "--num-gpu-blocks", "64",
                       "--ssl-certfile", str(c.replica.cert), "--ssl-keyfile", str(c.replica.key),
                       "--ssl-ca-certs", str(c.ca.cert)], "replica")
    p = Proc(proc, f"https://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", log)

    def serving() -> bool:
        with c.to_replica(p, c.router) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return bool(r.status == health_pb2.HealthCheckResponse.SERVING)
    return wait_for(p, serving, "the TLS replica")


def start_router(c: Certs, replica: Proc, *tls_flags: str, public_tls: bool, routing: str, healthy: int) -> Proc:
    http_port, grpc_port = free_port(), free_port()
    spec = f"127.0.0.1:{replica.http.rsplit(':', 1)[1]}:{replica.grpc_address.rsplit(':', 1)[1]}"
    public = ["--ssl-certfile", str(c.router.cert), "--ssl-keyfile", str(c.router.key)] if public_tls else []
    proc, log = spawn(["router", "--port", str(http_port), "--grpc-port", str(grpc_port), "--replicas", spec,
                       "--routing", routing, "--api-key", KEY_A, "--api-key", KEY_B, "--api-key", ROUTER_ONLY_KEY,
                       "--health-interval-s", "0.5", "--log-level", "warning", *public, *tls_flags],
                      f"router-{routing}")
    scheme = "https" if public_tls else "http"
    p = Proc(proc, f"{scheme}://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", log)

    def checked() -> bool:  # its first round of checks is over, with the expected outcome
        with c.https() as client:
            m = client.get(f"{p.http}/metrics", headers=dict(auth()), timeout=5).text
        return f"nanokv_router_healthy_replicas {float(healthy)}" in m and "nanokv_router_replica_healthy{" in m
    return wait_for(p, checked, f"router ({routing})", timeout_s=60)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    ca = CA.create(folder / "ca")
    c = Certs(ca, ca.issue("replica", host=None, dns=(REPLICA_NAME,)), ca.issue("router", client=True),
              CA.create(folder / "other", "other").issue("stranger", server=False, client=True))
    procs: list[Proc] = []
    try:
        replica = start_replica(c)
        procs.append(replica)
        client_cert = ["--replica-ssl-certfile", str(c.router.cert), "--replica-ssl-keyfile", str(c.router.key)]
        good = start_router(c, replica, "--replica-ssl-ca-certs", str(ca.cert), *client_cert,
                            "--replica-ssl-server-name", REPLICA_NAME, public_tls=True, routing="kv", healthy=1)
        procs.append(good)
        nocert = start_router(c, replica, "--replica-ssl-ca-certs", str(ca.cert), "--replica-ssl-server-name",
                              REPLICA_NAME, public_tls=False, routing="round_robin", healthy=0)
        procs.append(nocert)
        yield c, replica, good, nocert
    finally:
        for p in reversed(procs):  # the routers first: the replica's shutdown waits on no stream of theirs
            p.stop()


def test_key_files_are_owner_only(stack):
    c, *_ = stack
    for pair in (c.replica, c.router, c.stranger):
        assert pair.key.stat().st_mode & 0o777 == 0o600, pair.key


def test_the_gateway_refuses_clients_without_its_cas_certificate(stack):
    c, replica, _, _ = stack
    req = pb.GetServerInfoRequest()
    with c.to_replica(replica, c.router) as ch:  # the right certificate
        assert pb_grpc.GenerationStub(ch).GetServerInfo(req, metadata=auth(), timeout=10).kv_blocks_total == 64
    for name, client in (("no client certificate", None), ("another CA's", c.stranger)):
        with c.to_replica(replica, client) as ch, pytest.raises(grpc.RpcError) as e:
            pb_grpc.GenerationStub(ch).GetServerInfo(req, metadata=auth(), timeout=10)
        # (gRPC's own words: "Socket closed", the server having refused the certificate after the handshake)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (name, e.value.details())
    with grpc.insecure_channel(replica.grpc_address) as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.GenerationStub(ch).GetServerInfo(req, metadata=auth(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # HTTP: the same certificate check on the OpenAI port
    with c.https(c.router) as client:
        assert client.get(f"{replica.http}/v1/models", headers=dict(auth()), extensions=SNI).status_code == 200
    with c.https(c.router) as client, pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        client.get(f"{replica.http}/v1/models", headers=dict(auth()))  # its certificate names no address
    for client_cert in (None, c.stranger):
        with c.https(client_cert) as client, pytest.raises(httpx.TransportError):
            client.get(f"{replica.http}/v1/models", headers=dict(auth()), timeout=10, extensions=SNI)
    with pytest.raises(httpx.TransportError):  # plaintext to the TLS port
        httpx.get(replica.http.replace("https://", "http://") + "/v1/models", timeout=10)


def health(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanokv.cli", "health", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def test_the_health_probe_of_a_mutual_tls_gateway(stack):
    """`nanokv health` with the pod's client certificate: the probe deploy/k8s/components/tls runs (a
    kubelet's grpc probe speaks no TLS); without a certificate, or with another CA's, it reports 2."""
    c, replica, _, _ = stack
    ca = ["--ssl-ca-certs", str(c.ca.cert), "--ssl-server-name", REPLICA_NAME]
    mine = ["--ssl-certfile", str(c.router.cert), "--ssl-keyfile", str(c.router.key)]
    ok = health(replica.grpc_address, *ca, *mine)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, (ok.stdout, ok.stderr)
    theirs = ["--ssl-certfile", str(c.stranger.cert), "--ssl-keyfile", str(c.stranger.key)]
    for flags in ([], theirs):
        r = health(replica.grpc_address, *ca, *flags)
        assert r.returncode == 2 and "UNAVAILABLE" in r.stderr, (flags, r.stdout, r.stderr)
    plain = health(replica.grpc_address)  # plaintext to the TLS port
    assert plain.returncode == 2 and "UNAVAILABLE" in plain.stderr, plain.stderr
    half = health(replica.grpc_address, *ca, "--ssl-certfile", str(c.router.cert))
    assert half.returncode != 0 and "ssl_keyfile" in half.stderr, half.stderr  # the flag is named


def test_the_router_answers_through_the_tls_replica(stack):
    c, replica, good, _ = stack
    with c.https(c.router) as direct_client, c.https() as client:
        body = {"model": MODEL, "messages": PROMPT, "max_tokens": 10, "temperature": 0}
        r = direct_client.post(f"{replica.http}/v1/chat/completions", json=body, headers=dict(auth()),
                               extensions=SNI)
        direct = r.json()["choices"][0]["message"]["content"]
        routed = chat(client, good.http, PROMPT, max_tokens=10)["choices"][0]["message"]["content"]
    assert routed == direct and direct
    req = pb.GenerateRequest(text="The capital of France is",
                             sampling_params=pb.SamplingParams(max_tokens=6, temperature=0))
    with grpc.secure_channel(good.grpc_address, c.creds()) as ch, c.to_replica(replica, c.router) as ch2:
        a = list(pb_grpc.GenerationStub(ch).Generate(req, metadata=auth(), timeout=120))
        b = list(pb_grpc.GenerationStub(ch2).Generate(req, metadata=auth(), timeout=120))
    assert [t for x in a for t in x.token_ids] == [t for x in b for t in x.token_ids] and a[-1].finished
    with pytest.raises(httpx.TransportError):  # the router's own port is TLS only
        httpx.get(good.http.replace("https://", "http://") + "/health", timeout=10)


def test_the_callers_key_is_carried_through_tls(stack):
    c, _, good, _ = stack
    msgs = [{"role": "user", "content": "Key carried check: " + "a shared preamble sentence. " * 10}]
    with c.https() as client:
        chat(client, good.http, msgs, key=KEY_A)
        time.sleep(0.3)  # (its events reach the router)
        again = chat(client, good.http, msgs, key=KEY_A)["usage"]["prompt_tokens_details"]["cached_tokens"]
        other = chat(client, good.http, msgs, key=KEY_B)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert again > 0 and other == 0  # the replica saw each caller's own key: two tenants, two caches
        body = {"model": MODEL, "messages": msgs, "max_tokens": 2}
        # a key the router takes but the replica does not: the replica's 401 comes back (the caller's
        # key went on, not the router's own); a key neither takes: the router's 401
        for key in (ROUTER_ONLY_KEY, "wrong-key"):
            r = client.post(f"{good.http}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 401, (key, r.status_code, r.text)
    req = pb.GenerateRequest(text="Hello", sampling_params=pb.SamplingParams(max_tokens=2, temperature=0))
    with grpc.secure_channel(good.grpc_address, c.creds()) as ch:
        stub = pb_grpc.GenerationStub(ch)
        for key in (ROUTER_ONLY_KEY, "wrong-key"):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, metadata=auth(key), timeout=60))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (key, e.value.details())


def test_a_router_without_a_client_certificate_is_refused_with_a_clear_status(stack):
    c, replica, _, nocert = stack
    with httpx.Client(timeout=10) as client:
        m = client.get(f"{nocert.http}/metrics", headers=dict(auth())).text
        assert "nanokv_router_healthy_replicas 0.0" in m and "nanokv_router_replica_healthy{" in m
        ready = client.get(f"{nocert.http}/ready")
        assert ready.status_code == 503 and ready.json()["reason"] == "no healthy replica", ready.text
        t0 = time.monotonic()
        r = client.post(f"{nocert.http}/v1/chat/completions", headers=dict(auth()),
                        json={"model": MODEL, "messages": PROMPT, "max_tokens": 2})
        assert time.monotonic() - t0 < 5  # refused at once, not after a connect timeout
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    # the router names the replica and the cause: it asked for a client certificate the router has not
    assert "no healthy replica" in message and "TLS: the replica closed" in message, message
    assert replica.grpc_address.split(":")[1] in message, message
    with grpc.insecure_channel(nocert.grpc_address) as ch, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(text="Hi"), metadata=auth(), timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no healthy replica" in (e.value.details() or "")
    # its log says which replica failed its checks and why (once, not every half second)
    lines = [ln for ln in nocert.text().splitlines() if "failed its check" in ln]
    assert len(lines) == 1 and replica.grpc_address.split(":")[1] in lines[0], lines


def test_bad_tls_settings_name_the_flag(tmp_path):
    ca = CA.create(tmp_path)
    a, b = ca.issue("a"), ca.issue("b")
    with pytest.raises(ConfigError, match="ssl_keyfile"):
        ServerTLS.build(str(a.cert), None)
    with pytest.raises(ConfigError, match="ssl_certfile.*do not load together"):
        ServerTLS.build(str(a.cert), str(b.key))  # a's certificate, b's key
    with pytest.raises(ConfigError, match="ssl_cert_reqs"):
        ServerTLS.build(str(a.cert), str(a.key), cert_reqs="optional")  # optional client certs, but whose CA?
    with pytest.raises(ConfigError, match="ssl_ca_certs.*cannot read"):
        ServerTLS.build(str(a.cert), str(a.key), str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="ssl_ca_certs.*needs"):
        ServerTLS.build(None, None, str(ca.cert))
    assert ServerTLS.build(None, None) is None
    assert ServerTLS.build(str(a.cert), str(a.key), str(ca.cert)).cert_reqs == "required"  # mutual by default
    (tmp_path / "x.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="replica_ssl_certfile.*not PEM"):
        ClientTLS.build(False, None, str(tmp_path / "x.pem"), str(a.key), None)
    assert ClientTLS.build(False, None, None, None, None) is None
    assert ClientTLS.build(True, None, None, None, None) == ClientTLS()
    # on the command line: the process stops at once, naming the flag
    r = subprocess.run([sys.executable, "-m", "nanokv.cli", "router", "--replicas", "127.0.0.1:1:2",
                        "--replica-ssl-certfile", str(a.cert)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "replica_ssl_keyfile" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "nanokv.cli", "serve", "--ssl-certfile", str(a.cert), "--ssl-keyfile",
                        str(b.key)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "--ssl-certfile" in r.stderr and "do not load together" in r.stderr, r.stderr
