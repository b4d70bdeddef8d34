"""A short `nanokv soak` (nanokv_tools.bench.soak): three real processes, gRPC and HTTP streams of two
tenants with cancellations, a compute SIGKILL + restart a third of the way in. Every invariant of
the long run must hold here too: no leaked block or sequence, no cross-tenant or cross-salt prefix
hit, the same greedy tokens before and after the restart, and no failure other than the outage's."""

from __future__ import annotations

import argparse

from nanokv_tools.bench.soak import add_soak_args, print_summary, run_soak

OUTAGE = {"grpc:UNAVAILABLE", "http:503", "http:stream-error:engine_unavailable"}


def test_short_soak_with_a_compute_restart(capsys):
    p = argparse.ArgumentParser()
    add_soak_args(p)
    args = p.parse_args(["--minutes", "0.6", "--clients", "4", "--kill-at", "0.35", "--warmup-s", "5",
                         "--rss-interval-s", "5", "--probe-interval-s", "8"])
    r = run_soak(args, log=lambda _: None)
    with capsys.disabled():
        print_summary(r)
    assert r["leaked_blocks"] == 0 and r["cache_num_seqs"] == 0 and r["compute_num_seqs"] == 0
    probes = r["tenant_probes"]
    assert probes["run"] >= 2 and probes["same_tenant_hits"] == probes["run"]
    assert probes["cross_tenant_hit_tokens"] == 0 and probes["cross_salt_hit_tokens"] == 0
    assert r["greedy_probes"] == 3 and r["greedy_mismatches"] == 0
    assert r["compute_restart"]["ready_after_s"] < 60
    requests = r["requests"]
    assert requests.get("ok", 0) >= 10 and requests.get("cancelled", 0) >= 1
    assert set(requests) - {"ok", "cancelled"} <= OUTAGE, requests
    assert {x["process"] for x in r["rss"]} == {"cache", "compute", "gateway"}
    assert r["ok"]
