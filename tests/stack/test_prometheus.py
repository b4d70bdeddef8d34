"""The Grafana board and the alert rules, answered by a real Prometheus over real services.

Debian's `prometheus` server (a child process, its own data folder, loopback only) runs the compose
stack's deploy/prometheus.yml with local targets and 1 s scrape and rule intervals. It scrapes the
gateway's /metrics and the cache and compute services' own endpoints (nanokv.service_metrics),
three real processes, while real traffic runs through the OpenAI API (greedy requests, one of them
a prefix-cache hit) and one RPC fails on purpose. Then every expression of nanokv/ops/grafana.json
must return data through /api/v1/query, and every rule of nanokv/ops/alerts.yml must be loaded and
evaluated with health "ok" (/api/v1/rules).

Alert expressions are conditions (`x > 0.5`): on a healthy stack most are rightly empty, so an empty
result proves nothing. For those the test checks what would make them wrong: the rule evaluated
without error, the expression itself runs, and every series it reads exists in the real scrapes (a
renamed metric would leave the rule silently empty forever). The one rule this run can make true,
NanoKVServiceDown, is made true: the compute service is stopped and the alert must go pending.

The server binary comes with `make tools`; without it the test skips, except under CI=true, where a
missing binary fails it.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import pytest
import yaml
from nanokv_tools.bench.metrics_stack import JOBS, ScrapedStack
from nanokv_tools.bench.prometheus import ALERTS, BOARD, DEPLOY_CONFIG, Prometheus, binary, local_config

from nanokv.protos import internal_pb2 as ipb
from nanokv.protos import internal_pb2_grpc as ipb_grpc
from nanokv.rpc import channel
from tests.helpers_grpc import free_port

PREFIX = "The capital of France is Paris. The capital of Italy is Rome. The capital of Germany is Berlin. "
# adaptive in recommend mode: the controller counts (nanokv_adaptations_total has series) but never acts
CONFIG = {"device": "cpu", "dtype": "float32", "num_gpu_blocks": 256, "block_size": 16,
          "adaptive": True, "adaptive_mode": "recommend"}
NAME = re.compile(r"\b(nanokv_[a-z0-9_]+|up)\b")


def _binary() -> str:
    exe = binary()
    if exe is None:
        reason = "Debian's prometheus server is not installed (make tools: apt-get install -y prometheus)"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(reason + "; under CI it must be")
        pytest.skip(reason)
    return exe


def _board_exprs() -> list[tuple[str, str]]:
    board = json.loads(BOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]


def _rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def _poll(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.5)


def _complete(base: str, prompt: str) -> str:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    exe = _binary()
    run = tmp_path_factory.mktemp("prom")
    ports = {job: free_port() for job in JOBS}
    jobs = [j["job_name"] for j in yaml.safe_load(DEPLOY_CONFIG.read_text())["scrape_configs"]]
    assert sorted(jobs) == sorted(JOBS)  # the compose stack scrapes the three services, under these jobs
    prom = Prometheus(local_config({j: f"127.0.0.1:{p}" for j, p in ports.items()}), exe)
    services = None
    try:
        services = ScrapedStack(run, CONFIG, ports)
        base = services.base
        # traffic: the same prompt twice (the second is a prefix-cache hit), then one sharing its prefix
        texts = [_complete(base, PREFIX + "The capital of Spain is") for _ in range(2)]
        texts.append(_complete(base, PREFIX + "The capital of Egypt is"))
        # a request the API refuses (nanokv_requests_rejected_total{status="400"})
        bad = httpx.post(f"{base}/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "hi",
                                                         "max_tokens": -1}, timeout=30)
        # one RPC that fails: the cache service has no ghost of policy "nope" (FAILED_PRECONDITION)
        with channel(services.cache) as ch:
            with pytest.raises(grpc.RpcError) as failed:
                ipb_grpc.CacheStub(ch).SetPolicy(ipb.SetPolicyRequest(policy="nope"), timeout=10)
        yield {"prom": prom, "services": services, "texts": texts, "failed_code": failed.value.code(), "bad": bad}
    finally:
        if services is not None:
            services.stop()
        prom.stop()


def test_traffic_was_real(stack):
    a, b, c = stack["texts"]
    assert a == b and "Madrid" in a, stack["texts"]  # greedy: the prefix hit answers the same tokens
    assert "Cairo" in c, c
    assert stack["failed_code"] == grpc.StatusCode.FAILED_PRECONDITION
    assert stack["bad"].status_code == 400 and "max_tokens" in stack["bad"].text


def test_every_board_query_returns_data(stack):
    prom: Prometheus = stack["prom"]
    # wait for scrapes after the traffic (the failed RPC came last); series the traffic created need a
    # second sample before rate() answers, which the polling below of each query allows for
    _poll(lambda: prom.query('nanokv_rpc_server_handled_total{method="SetPolicy", code!="OK"}'), 30,
          "the traffic in Prometheus")
    exprs = _board_exprs()
    assert len(exprs) >= 30
    # the memory hierarchy's panels have series only with lower tiers on, which this stack cannot have
    # (the adaptive controller it runs for nanokv_adaptations refuses them): test_hierarchy.py checks
    # those families on a tiered engine
    tiered = [(title, e) for title, e in exprs if "nanokv_tier_" in e]
    assert len(tiered) == 6
    exprs = [x for x in exprs if x not in tiered]
    empty = [(title, e) for title, e in exprs if not _poll_quiet(lambda e=e: prom.query(e), 10)]
    assert not empty, f"board queries without data: {empty}\n{prom.log_tail()}"

    def value(expr: str) -> float:
        return float(prom.query(expr)[0]["value"][1])
    # the numbers behind the panels are the traffic's: hits, tokens, RPCs by method and code, the pool
    assert value("sum(rate(nanokv_prefix_cache_hit_tokens_total[5m]))") > 0
    assert value("sum(rate(nanokv_generation_tokens_total[5m]))") > 0
    codes = {(s["metric"]["service"], s["metric"]["method"], s["metric"]["code"])
             for s in prom.query("nanokv_rpc_server_handled_total")}
    assert ("nanokv.internal.v1.Cache", "Plan", "OK") in codes
    assert ("nanokv.internal.v1.Compute", "Step", "OK") in codes
    assert ("nanokv.internal.v1.Cache", "SetPolicy", "FAILED_PRECONDITION") in codes
    assert value('sum(nanokv_cache_pool_blocks)') == 256
    assert value('histogram_quantile(0.99, sum by (le) (rate(nanokv_rpc_server_handling_seconds_bucket'
                 '{method="Step"}[5m])))') > 0
    # no double counting: a family the gateway exports comes from no other job, and the services'
    # own families never from the gateway
    owners: dict[str, set[str]] = {}
    for s in prom.query('group by (__name__, job) ({__name__=~"nanokv_.+"})'):
        owners.setdefault(s["metric"]["__name__"], set()).add(s["metric"]["job"])
    shared = {n: j for n, j in owners.items() if "nanokv-gateway" in j and j != {"nanokv-gateway"}}
    assert not shared, shared
    assert owners["nanokv_rpc_server_handled_total"] == {"nanokv-cache", "nanokv-compute"}
    assert owners["nanokv_cache_pool_blocks"] == {"nanokv-cache"}

def _poll_quiet(fn: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = fn()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def test_every_alert_rule_is_loaded_and_evaluated(stack):
    prom: Prometheus = stack["prom"]
    wanted = _rules()
    started = time.time()

    def evaluated_since_now() -> list[dict[str, Any]]:
        got = prom.rules()
        fresh = [r for r in got if r["lastEvaluation"] and _epoch(r["lastEvaluation"]) > started]
        return got if len(fresh) == len(got) == len(wanted) else []
    loaded = {r["name"]: r for r in _poll(evaluated_since_now, 15, "every rule evaluated")}
    assert sorted(loaded) == sorted(r["alert"] for r in wanted)
    bad = {n: (r["health"], r.get("lastError")) for n, r in loaded.items() if r["health"] != "ok"}
    assert not bad, bad
    missing = []
    for rule in wanted:
        prom.query(rule["expr"])  # runs (an empty answer is a condition not met)
        for name in sorted(set(NAME.findall(rule["expr"]))):
            if not prom.query(f'group({{__name__="{name}"}})'):
                missing.append((rule["alert"], name))
    assert not missing, f"rules read series that no service exports: {missing}"


def _epoch(rfc3339: str) -> float:
    from datetime import datetime

    head = re.sub(r"(\.\d{6})\d*", r"\1", rfc3339).replace("Z", "+00:00")
    return datetime.fromisoformat(head).timestamp()


def test_a_stopped_service_raises_the_service_down_alert(stack):
    prom: Prometheus = stack["prom"]
    # all three were scraped (a single scrape can time out on a loaded box: `up` is 0 for that one,
    # which is why the rule waits a minute before it fires)
    seen = {s["metric"]["job"]: float(s["value"][1]) for s in prom.query("max_over_time(up[1m])")}
    assert seen == {"nanokv-gateway": 1.0, "nanokv-cache": 1.0, "nanokv-compute": 1.0}
    stack["services"].stop_one("compute")  # SIGTERM

    def compute_down() -> list[dict[str, Any]]:
        return [a for a in prom.alerts()
                if a["labels"]["alertname"] == "NanoKVServiceDown" and a["labels"]["job"] == "nanokv-compute"]
    (alert,) = _poll(compute_down, 20, "NanoKVServiceDown for the compute service")
    assert alert["state"] == "pending" and float(alert["value"]) == 0  # `for: 1m`: pending first
    assert alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["summary"] == f"nanokv nanokv-compute down on {alert['labels']['instance']}"


def test_compose_stack_scrapes_what_the_services_serve():
    """deploy/prometheus.yml's targets are docker-compose.yml's services (by name or network alias, on
    both profiles) at the port their command serves /metrics on, bound beyond loopback."""
    compose = yaml.safe_load((DEPLOY_CONFIG.parents[1] / "docker-compose.yml").read_text())["services"]
    targets = {j["job_name"]: j["static_configs"][0]["targets"]
               for j in yaml.safe_load(DEPLOY_CONFIG.read_text())["scrape_configs"]}
    for profile in ("cpu", "gpu"):
        names: dict[str, dict[str, Any]] = {}
        for name, spec in compose.items():
            if profile in (spec.get("profiles") or [profile]):
                aliases = (spec.get("networks") or {}).get("default", {}).get("aliases", [])
                names.update({n: spec for n in [name, *aliases]})
        for job, (target,) in targets.items():
            host, port = target.split(":")
            assert host in names, (profile, job, target)
            cmd = names[host]["command"]
            flag = "--port" if job == "nanokv-gateway" else "--metrics-port"
            assert cmd[cmd.index(flag) + 1] == port, (profile, job, cmd)
            bind = "--host" if job == "nanokv-gateway" else "--metrics-host"
            assert cmd[cmd.index(bind) + 1] == "0.0.0.0", (profile, job, cmd)
