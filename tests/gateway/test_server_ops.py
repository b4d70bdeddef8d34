"""Ops artefacts: the Prometheus alert rules and the Grafana dashboard.

Rules are checked (and unit-tested) with promtool; every metric name in every rule and dashboard
expression must appear in the /metrics output of a live server running the real engine.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from nanokv.gateway.http import build_app
from nanokv.gateway.http.testing import serve_in_thread, shared_engine
from nanokv.service_metrics import OWN_PREFIXES

OPS = Path(__file__).resolve().parents[2] / "nanokv" / "ops"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian/Ubuntu: apt-get install -y prometheus)"
)
NAME = re.compile(r"\bnanokv_[a-z0-9_]+\b")


def rule_exprs() -> list[str]:
    doc = yaml.safe_load((OPS / "alerts.yml").read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    dash = json.loads((OPS / "grafana.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


@needs_promtool
def test_promtool_check_rules():
    r = subprocess.run([PROMTOOL, "check", "rules", str(OPS / "alerts.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_rule_unit_tests():
    cmd = [PROMTOOL, "test", "rules", "alerts_test.yml"]
    r = subprocess.run(cmd, cwd=OPS, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_is_valid_grafana_json():
    dash = json.loads((OPS / "grafana.json").read_text())
    assert dash["title"] and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]


def exported_names(text: str) -> set[str]:
    """Every name a PromQL expression may use: sample names plus counter `_total` names."""
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
        if fam.type == "counter":
            names.add(fam.name + "_total")
    return names


def test_every_expression_metric_is_exported():
    app = build_app(shared_engine(), api_key="ops-key")
    with serve_in_thread(app) as url:
        text = httpx.get(url + "/metrics", headers={"Authorization": "Bearer ops-key"}).text
    exported = exported_names(text)
    # the cache and compute services' own families (nanokv.service_metrics) are not the gateway's:
    # tests/stack/test_prometheus.py finds them in a real Prometheus scraping those services
    used = {(where, n) for where, exprs in (("alerts.yml", rule_exprs()), ("grafana.json", dashboard_exprs()))
            for e in exprs for n in NAME.findall(e) if not n.startswith(OWN_PREFIXES)}
    assert len({n for _, n in used}) >= 15  # the dashboard covers the whole metric set
    missing = sorted((w, n) for w, n in used if n not in exported)
    assert not missing, f"expressions use metrics the server does not export: {missing}"
    # every metric family the server exports has the nanokv_ prefix and shows on the dashboard
    families = {f.name for f in text_string_to_metric_families(text)}
    assert all(f.startswith("nanokv_") for f in families), families
    shown = " ".join(dashboard_exprs())
    assert not [f for f in families if f not in shown and not f.endswith("_created")], families


def test_engine_failure_turns_health_red(monkeypatch):
    engine = shared_engine()

    def broken_step():
        raise RuntimeError("simulated engine bug")

    monkeypatch.setattr(engine, "step", broken_step)
    app = build_app(engine)
    with serve_in_thread(app) as url:
        assert httpx.get(url + "/health").status_code == 200
        body = {"model": engine.model_name, "prompt": "hi", "max_tokens": 2}
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 503 and "simulated engine bug" in r.json()["error"]["message"]
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "simulated engine bug" in health.json()["reason"]
        r = httpx.post(url + "/v1/completions", json={"model": engine.model_name, "prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    # the failed request was aborted on the way out: nothing is left holding KV blocks
    assert not engine.has_unfinished_requests() and engine.cache_manager.num_used_blocks() == 0
