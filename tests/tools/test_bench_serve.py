"""`nanokv bench serve`: its arrival schedules and trace prompts, and real runs against a real `nanokv serve`
(the embedded model, small pool) over the OpenAI HTTP API and the nanokv.v1 gRPC API.

The runs assert what must hold whatever the speed: every request completed, TTFT <= E2EL, token counts
equal the server's usage, percentiles ordered, a repeated prefix served from the cache, a chat turn
sent only after its previous turn answered. Nothing asserts on speed.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from nanokv_tools.bench import serve
from nanokv_tools.bench.serve_args import parse_rates
from nanokv_tools.bench.serve_launch import launch
from nanokv_tools.bench.serve_report import METRICS, percentile
from nanokv_tools.bench.serve_workloads import TokenSource, arrival_times, build_shapes, render_prompt
from nanokv_tools.sim.traces import MOONCAKE_TRACE, read_mooncake

from nanokv.errors import NanoKVError

ROOT = Path(__file__).resolve().parents[2]
KEY = "bench-serve-key"
SERVER_FLAGS = (f"--api-key {KEY} --device cpu --dtype float32 --block-size 16 --num-gpu-blocks 256 "
                "--max-num-seqs 16 --log-level warning")


def test_poisson_arrivals_follow_the_rate():
    gaps = np.diff(arrival_times(4000, 5.0, seed=7))
    assert abs(gaps.mean() - 0.2) < 0.2 * 0.05  # mean gap 1 / rate
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.06  # exponential gaps: coefficient of variation 1
    assert arrival_times(50, 5.0, seed=7) == arrival_times(50, 5.0, seed=7)
    assert arrival_times(50, 5.0, seed=7) != arrival_times(50, 5.0, seed=8)
    assert arrival_times(50, 5.0, seed=7)[0] == 0.0
    regular = np.diff(arrival_times(4000, 5.0, seed=7, burstiness=4.0))  # gamma shape 4: CV 1/2
    assert abs(regular.mean() - 0.2) < 0.01 and abs(regular.std() / regular.mean() - 0.5) < 0.04
    assert arrival_times(6, float("inf"), seed=0) == [0.0] * 6
    assert arrival_times(3, 1.0, seed=0, trace_s=[2.0, 2.5, 4.0], trace_speedup=2.0) == [0.0, 0.25, 1.0]


def test_bad_input_names_the_field():
    for call, field in ((lambda: parse_rates("1,0"), "request_rate"), (lambda: parse_rates("fast"), "request_rate"),
                        (lambda: build_shapes("sharegpt", num_prompts=2, seed=0, max_output_tokens=4), "workload"),
                        (lambda: arrival_times(3, 1.0, seed=0, burstiness=0.0), "burstiness")):
        with pytest.raises(NanoKVError) as e:
            call()
        assert e.value.field == field


def test_percentile_is_numpys_linear():
    rng = random.Random(3)
    for n in (1, 2, 7, 100):
        xs = [rng.random() for _ in range(n)]
        for p in (50, 90, 99):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))


def test_mooncake_hash_ids_become_shared_prefixes():
    trace = read_mooncake(MOONCAKE_TRACE)[:100]
    shapes = build_shapes("mooncake", num_prompts=100, seed=0, max_output_tokens=8, block_tokens=16)
    src = TokenSource("t", 1000, 30000)
    prompts = [render_prompt(s, i, src, 16) for i, s in enumerate(shapes)]
    pairs = 0
    for i in range(len(trace)):
        for j in range(i):
            a, b = trace[i].hash_ids, trace[j].hash_ids
            common = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            if common and common < min(len(a), len(b)):
                pairs += 1
                assert prompts[i][:16 * common] == prompts[j][:16 * common]
                assert prompts[i][16 * common:16 * common + 16] != prompts[j][16 * common:16 * common + 16]
    assert pairs > 0
    for r, s, p in zip(trace, shapes, prompts):
        assert len(p) == 16 * (len(r.hash_ids) - 1) + s.last_block_tokens
        assert 1 <= s.last_block_tokens <= 16 and s.max_tokens == min(max(1, r.output_length), 8)
    other = TokenSource("u", 1000, 30000)
    assert render_prompt(shapes[0], 0, other, 16) != prompts[0]  # each rate's namespace starts cold


@pytest.fixture(scope="module")
def server():
    with launch("serve", SERVER_FLAGS, timeout_s=300, log=lambda _: None) as s:
        yield s


def _check_run(run: dict, n: int) -> None:
    s = run["summary"]
    assert s["completed"] == n and s["failed"] == 0 and len(run["requests"]) == n
    for metric in METRICS:
        assert s[f"median_{metric}_ms"] <= s[f"p90_{metric}_ms"] <= s[f"p99_{metric}_ms"]
    recs = run["requests"]
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in recs)
    assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in recs)
    assert s["prefix_hit_ratio"] == pytest.approx(sum(r["cached_tokens"] for r in recs) / s["total_input_tokens"])
    ttfts = [r["ttft_s"] * 1000 for r in recs]
    assert min(ttfts) <= s["mean_ttft_ms"] <= max(ttfts)
    for r in recs:
        assert r["success"] and r["error"] == ""
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["sent_s"] >= r["scheduled_s"]  # never sent before it is due
        assert r["prompt_tokens"] == r["prompt_len"]  # token-id prompts: the server counts what was sent
        assert r["output_tokens"] == r["max_tokens"]  # ignore_eos: exactly max_tokens
        assert 0 <= r["cached_tokens"] <= r["prompt_tokens"]
        assert 1 <= r["chunks"] <= r["output_tokens"] and len(r["itl_s"]) == r["chunks"] - 1


def test_openai_http_run_through_the_command_line(server, tmp_path):
    out = tmp_path / "http.json"
    cmd = [sys.executable, "-m", "nanokv.cli", "bench", "serve", "--base-url", server.base_url, "--api-key", KEY,
           "--workload", "random", "--num-prompts", "6", "--random-input-len", "24", "--random-prefix-len", "32",
           "--random-output-len", "4", "--random-range-ratio", "0.5", "--request-rates", "4,inf", "--seed", "1",
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=os.environ)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TTFT p50/p90/p99 ms" in done.stdout and (tmp_path / "http.png").stat().st_size > 0
    assert KEY not in out.read_text()  # the API key is not written into shareable results
    result = json.loads(out.read_text())
    assert result["backend"] == "openai" and result["model"]
    assert [r["request_rate"] for r in result["runs"]] == ["4", "inf"]
    for run in result["runs"]:
        _check_run(run, 6)
    paced = result["runs"][0]["requests"]
    assert [r["scheduled_s"] for r in paced] == pytest.approx(arrival_times(6, 4.0, seed=1))
    # the shared 32-token prefix is two whole blocks: paced requests after the first find it cached
    assert any(r["cached_tokens"] >= 32 for r in paced[1:])
    assert result["runs"][0]["cache_namespace"] != result["runs"][1]["cache_namespace"]


def test_grpc_chat_run(server, tmp_path):
    out = tmp_path / "grpc.json"
    argv = ["--backend", "grpc", "--grpc-address", server.grpc_address, "--api-key", KEY, "--workload", "chat",
            "--num-prompts", "6", "--chat-turns", "3", "--chat-system-len", "40", "--chat-user-len", "8",
            "--random-output-len", "3", "--max-output-tokens", "4", "--request-rates", "8,inf", "--out", str(out),
            "--no-plot"]
    assert serve.main(argv, log=lambda _: None) == 0
    result = json.loads(out.read_text())
    assert result["backend"] == "grpc" and result["model"]
    for run in result["runs"]:
        _check_run(run, 6)
        recs = run["requests"]
        for r in recs:
            assert r["streamed_tokens"] == r["output_tokens"]  # the token ids streamed are the usage's count
        by_turn = {(r["conv"], r["turn"]): r for r in recs}
        follow_ups = [r for r in recs if r["turn"] > 0]
        assert follow_ups
        for r in follow_ups:
            prev = by_turn[(r["conv"], r["turn"] - 1)]
            assert r["sent_s"] >= prev["sent_s"] + prev["e2e_s"]  # closed loop: sent after the answer
            assert r["prompt_len"] > prev["prompt_len"] + prev["output_tokens"]  # history + answer + message
            assert r["cached_tokens"] > 0  # the previous turn's prompt is a cached prefix
        assert statistics.mean(r["cached_tokens"] / r["prompt_tokens"] for r in follow_ups) > 0
