"""`nanokv up`: cache, compute and gateway as three processes, the OpenAI API and /metrics served by
the gateway, the cache counters in /metrics read from the cache service over gRPC."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest

from nanokv.tls import ClientTLS
from tests.helpers_tls import CA
from tests.helpers_up import nanokv_up, up_process


def test_up_serves_completions_and_cache_metrics(tmp_path):
    with nanokv_up(tmp_path, "--grpc-port", "0") as base:
        assert (tmp_path / "cache.sock").exists() and (tmp_path / "compute.sock").exists()
        prompt = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
        body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        texts = [httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
                 for _ in range(2)]
        assert texts[0] == texts[1] and "Madrid" in texts[0]
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        hits = re.search(r"^nanokv_prefix_cache_hit_tokens_total ([0-9.e+]+)$", metrics, re.M)
        assert hits is not None and float(hits.group(1)) >= 16  # the second request hit the first's blocks
    # the services die with it (SIGTERM: uvicorn re-raises it, so no cleanup code of `up` runs)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _services_of(tmp_path):
        time.sleep(0.2)
    assert _services_of(tmp_path) == []


def test_up_serves_https_with_mutual_tls(tmp_path):
    """`up` takes the gateway's --ssl-* flags: HTTPS for the client that shows a certificate of the
    CA, a refused handshake for one that shows none; a bad key file stops `up` before any service."""
    ca = CA.create(tmp_path / "pki")
    server, client = ca.issue("server"), ca.issue("client", server=False, client=True)
    tls = ["--ssl-certfile", str(server.cert), "--ssl-keyfile", str(server.key), "--ssl-ca-certs", str(ca.cert)]
    bad = nanokv_cli("up", "--port", "0", *tls[:2], "--ssl-keyfile", str(tmp_path / "missing.pem"))
    assert bad.returncode == 2 and "ssl_keyfile" in bad.stderr, bad.stderr
    run = tmp_path / "run"
    run.mkdir()
    mutual = ClientTLS(str(ca.cert), str(client.cert), str(client.key)).ssl_context()
    with httpx.Client(verify=mutual) as https, up_process(run, *tls, client=https) as up:
        assert up.base.startswith("https://")
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 3,
                "temperature": 0}
        r = https.post(f"{up.base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"]
        with httpx.Client(verify=ClientTLS(str(ca.cert), None, None).ssl_context()) as anonymous, \
                pytest.raises(httpx.HTTPError):
            anonymous.get(f"{up.base}/health", timeout=10)
        assert "gateway on https://" in up.output()


def nanokv_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanokv.cli", *argv], capture_output=True, text=True, timeout=120)


def _services_of(run_dir) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(run_dir) in cmd and " up " not in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p.pid)
    return out
