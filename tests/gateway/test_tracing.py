"""Traces: the span tree of a generation (in-process engine, the SDK's in-memory exporter), and the
same tree over the wire: `nanokv up` with OTEL_* set exports from all three processes to an OTLP
receiver in this test, the context crossing the gRPC links as traceparent metadata."""

from __future__ import annotations

import os
import time

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from nanokv import tracing  # noqa: E402
from nanokv.sampling import SamplingParams  # noqa: E402
from tests.helpers_up import nanokv_up  # noqa: E402

SHARED = "The capital of France is Paris. The capital of Italy is Rome. The capital of Germany is Berlin. "


@pytest.fixture
def memory_spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        yield exporter, provider
    finally:
        tracing.use_provider(None)


def test_span_tree_in_process(llm, memory_spans):
    exporter, provider = memory_spans
    prompts = [SHARED + "The capital of Spain is", SHARED + "The capital of Portugal is"]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tracing.use_provider(None)  # the reference: tracing off
    ref = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.cache.reset_prefix_cache()
    tracing.use_provider(provider)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    second = llm.generate(prompts[1:], params, use_tqdm=False)  # hits the first's cached prefix
    outs = first + second
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]  # tracing changes no token
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}

    reqs = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "text_completion"]
    assert len(reqs) == 2
    for s, o in zip(sorted(reqs, key=lambda s: s.start_time), outs):
        a = s.attributes
        assert a["gen_ai.request.model"] == llm.engine.model_name
        assert a["gen_ai.usage.input_tokens"] == len(o.prompt_token_ids)
        assert a["gen_ai.usage.output_tokens"] == len(o.token_ids) == 5
        assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
        assert a["nanokv.cached_tokens"] == o.num_cached_tokens
    assert outs[1].num_cached_tokens >= 16  # a real prefix hit, seen on its span

    steps = [s for s in spans if s.name == "nanokv.step"]
    assert steps and all(s.parent is None for s in steps)  # each step: its own trace
    for r in reqs:  # every token of a request came from a step linked to it
        served = [s for s in steps if any(ln.context.span_id == r.context.span_id for ln in s.links)]
        assert len(served) == r.attributes["gen_ai.usage.output_tokens"]
        assert all(s.context.trace_id != r.context.trace_id for s in served)
    for st in steps:
        kids = [s for s in spans if s.parent is not None and s.parent.span_id == st.context.span_id]
        names = {k.name for k in kids}
        if st.attributes.get("nanokv.batch_size"):
            assert "nanokv.cache.plan" in names
            assert names & {"nanokv.compute.prefill", "nanokv.compute.decode", "nanokv.compute.mixed"}
        for k in kids:
            assert k.context.trace_id == st.context.trace_id
    prefills = [s for s in spans if s.name == "nanokv.compute.prefill"]
    assert len(prefills) == 2 and all(s.attributes["nanokv.kv_format"] == "float32" for s in prefills)
    # the second request's admission: its plan saw the prefix hit and allocated only the rest
    plans = [s for s in spans if s.name == "nanokv.cache.plan" and s.attributes.get("nanokv.admitted")]
    hits = [s.attributes["nanokv.cached_tokens"] for s in plans]
    assert hits == [0, outs[1].num_cached_tokens]
    assert all(s.attributes["nanokv.blocks_allocated"] >= 1 for s in plans)
    ev = [e for e in plans[1].events if e.name == "prefix lookup"]
    assert ev and ev[0].attributes["nanokv.cached_tokens"] == outs[1].num_cached_tokens
    assert all(s.parent is None or s.parent.span_id in by_id for s in spans)  # no dangling parents


def _step_tree(spans: list[dict], step: dict) -> dict[str, list[dict]]:
    """The spans under one gateway step span, by name (a step may hold several calls of one method:
    the last step of a request also flushes the ended sequence, an empty Plan and Step)."""
    tree: dict[str, list[dict]] = {}
    frontier = {step["span_id"]}
    while frontier:
        kids = [s for s in spans if s["parent"] in frontier]
        for k in kids:
            tree.setdefault(k["name"], []).append(k)
        frontier = {k["span_id"] for k in kids}
    return tree


def test_spans_from_all_three_services_over_otlp(tmp_path):
    """The export path of each process, end to end: the batch processors wait 10 minutes, so every
    span reaches the receiver only through the flush each process does when it stops (the gateway's
    from its app shutdown: uvicorn re-raises SIGTERM, no atexit runs there)."""
    from otlp_receiver import Receiver

    rx = Receiver()
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
           "OTEL_BSP_SCHEDULE_DELAY": "600000"}
    env.pop("OTEL_SERVICE_NAME", None)  # each process names itself: nanokv-gateway / -cache / -compute
    traceparent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"  # the caller's trace: the API span continues it
    with nanokv_up(tmp_path, env=env, stop_timeout_s=60) as base:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": SHARED + "The capital of Spain is", "max_tokens": 4,
                "temperature": 0}
        r = httpx.post(f"{base}/v1/completions", json=body, headers={"traceparent": traceparent}, timeout=120)
        assert r.status_code == 200 and "Madrid" in r.json()["choices"][0]["text"]
        time.sleep(0.5)
        assert not rx.spans, "spans exported before shutdown: the batch delay was not read from OTEL_BSP_*"
    try:
        spans = rx.wait_for(lambda sp: {"nanokv-gateway", "nanokv-cache", "nanokv-compute"}
                            <= {s["service"] for s in sp}, 60)
        time.sleep(0.5)  # the last process's export
        spans = list(rx.spans)
    finally:
        rx.stop()
    services = {s["service"] for s in spans}
    assert {"nanokv-gateway", "nanokv-cache", "nanokv-compute"} <= services, services
    by_id = {s["span_id"]: s for s in spans}
    assert len(by_id) == len(spans)  # each span exported once
    http = [s for s in spans if s["name"] == "POST /v1/completions"]
    assert len(http) == 1 and http[0]["trace_id"] == "ab" * 16 and http[0]["parent"] == "cd" * 8
    req = [s for s in spans if s["attributes"].get("gen_ai.operation.name") == "text_completion"]
    assert len(req) == 1 and req[0]["parent"] == http[0]["span_id"] and req[0]["service"] == "nanokv-gateway"
    a = req[0]["attributes"]
    assert a["gen_ai.usage.output_tokens"] == 4 and a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    link = (req[0]["trace_id"], req[0]["span_id"])
    steps = sorted((s for s in spans if s["name"] == "nanokv.step" and link in s["links"]), key=lambda s: s["start_ns"])
    assert len(steps) == 4  # one step per generated token, each linked to the request, each its own trace
    assert len({s["trace_id"] for s in steps}) == 4 and all(s["parent"] is None for s in steps)
    assert all(s["trace_id"] != req[0]["trace_id"] for s in steps)
    kinds = []
    for st in steps:  # one trace, three services: gateway step -> gRPC server span -> the service's own span
        tree = _step_tree(spans, st)
        plans, calls = tree["nanokv.internal.v1.Cache/Plan"], tree["nanokv.internal.v1.Compute/Step"]
        assert {s["service"] for s in plans} == {"nanokv-cache"} and all(s["parent"] == st["span_id"] for s in plans)
        assert {s["service"] for s in calls} == {"nanokv-compute"} and all(s["parent"] == st["span_id"] for s in calls)
        plan = tree["nanokv.cache.plan"]
        assert plan and all(s["service"] == "nanokv-cache" and by_id[s["parent"]] in plans for s in plan)
        fwd = [s for name, ss in tree.items() if name.startswith("nanokv.compute.") for s in ss]
        assert len(fwd) == 1 and fwd[0]["service"] == "nanokv-compute" and by_id[fwd[0]["parent"]] in calls
        f = fwd[0]["attributes"]
        assert f["nanokv.kv_format"] == "float32" and f["gen_ai.request.model"] == "SmolLM2-135M-Instruct"
        assert f["nanokv.sample_rows"] == 1 and f["nanokv.num_prefills"] + f["nanokv.num_decodes"] == 1
        assert st["attributes"]["nanokv.batch_size"] == 1
        assert all(s["trace_id"] == st["trace_id"] for ss in tree.values() for s in ss)
        kinds.append(fwd[0]["name"])
    assert kinds == ["nanokv.compute.prefill"] + ["nanokv.compute.decode"] * 3
    first = _step_tree(spans, steps[0])
    assert any(s["attributes"].get("nanokv.blocks_allocated", 0) >= 1 for s in first["nanokv.cache.plan"])
    assert steps[0]["attributes"]["nanokv.prefill_tokens"] == a["gen_ai.usage.input_tokens"]
    assert all(s["parent"] is None or s["parent"] in by_id or s["parent"] == "cd" * 8 for s in spans)
