"""`python -m nanokv_tools.bench.trace_png [--out docs]`: the pictures of docs/operating.md, from a real run.

Starts Debian's Prometheus server (`apt-get install prometheus`; deploy/prometheus.yml with local
targets, scraping every second) and the three services, each serving its /metrics
(bench.metrics_stack), exporting spans over OTLP to a receiver in this process. Sends a short load
(two waves of requests sharing a prompt prefix), then one traced request alone. Writes
- trace.png: a waterfall of that request's trace and the step traces linked to it, one bar per
  span, coloured by the service that exported it;
- grafana-board.png: a matplotlib rendering (not a screenshot) of the panels of
  nanokv/ops/grafana.json, each expression answered by that Prometheus (/api/v1/query_range) over
  the run, with the rate windows shortened from minutes to 10 s to suit a run of seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from nanokv_tools.bench.metrics_stack import JOBS, ScrapedStack
from nanokv_tools.bench.otlp_receiver import Receiver
from nanokv_tools.bench.prometheus import BOARD, Prometheus, local_config

CONFIG = {"device": "cpu", "num_gpu_blocks": 512}
PREFIX = "The capital of France is Paris. The capital of Italy is Rome. The capital of Germany is Berlin. "
COUNTRIES = ["Spain", "Portugal", "Greece", "Poland", "Austria", "Sweden", "Norway", "Egypt"]
COLORS = {"nanokv-gateway": "#3b75af", "nanokv-cache": "#ef8636", "nanokv-compute": "#519e3e"}
TRACEPARENT_ID = "0af7651916cd43dd8448eb211c80319c"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(out: Path) -> dict[str, Any]:
    rx = Receiver()
    ports = {job: _port() for job in JOBS}
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
           "OTEL_BSP_SCHEDULE_DELAY": "200"}
    env.pop("OTEL_SERVICE_NAME", None)
    prom = Prometheus(local_config({j: f"127.0.0.1:{p}" for j, p in ports.items()}, interval_s=1.0))
    stack = None
    stop = threading.Event()
    try:
        stack = ScrapedStack(Path(tempfile.mkdtemp(prefix="nanokv-png-")), CONFIG, ports, env=env)
        base = stack.base
        t0 = time.time()
        stop.wait(3)
        for wave in (COUNTRIES[:4], COUNTRIES[4:]):  # the second wave hits the first's cached prefix
            threads = [threading.Thread(target=_complete, args=(base, PREFIX + f"The capital of {c} is", 24))
                       for c in wave]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            stop.wait(3)
        parent = f"00-{TRACEPARENT_ID}-{'b7ad6b7169203331'}-01"
        _complete(base, PREFIX + "The capital of Spain is", 4, {"traceparent": parent})
        stop.wait(3)
        t1 = time.time()
        spans = rx.wait_for(lambda sp: sum(s["name"] == "nanokv.step" for s in sp) > 20, 10)
        out.mkdir(parents=True, exist_ok=True)
        draw_board(prom, t0, t1, out / "grafana-board.png")
    finally:
        stop.set()
        if stack is not None:
            stack.stop()
        prom.stop()
        rx.stop()
    trace = _request_trace(spans)
    draw_waterfall(trace, out / "trace.png")
    return {"spans": len(spans), "trace_spans": len(trace), "seconds": round(t1 - t0, 1)}


def _complete(base: str, prompt: str, n: int, headers: dict[str, str] | None = None) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": n, "temperature": 0}
    httpx.post(f"{base}/v1/completions", json=body, headers=headers or {}, timeout=300).raise_for_status()


def _request_trace(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The traced request's spans, then each linked step's subtree, in start order."""
    mine = [s for s in spans if s["trace_id"] == TRACEPARENT_ID]
    req = next(s for s in mine if s["attributes"].get("gen_ai.operation.name"))
    steps = [s for s in spans if s["name"] == "nanokv.step" and (req["trace_id"], req["span_id"]) in s["links"]]
    step_traces = {s["trace_id"] for s in steps}
    return sorted(mine, key=lambda s: s["start_ns"]) + sorted(
        (s for s in spans if s["trace_id"] in step_traces), key=lambda s: (s["start_ns"], s["end_ns"]))


def draw_waterfall(trace: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(s["start_ns"] for s in trace)
    by_id = {s["span_id"]: s for s in trace}

    def depth(s: dict[str, Any]) -> int:
        d = 0
        while s["parent"] in by_id:
            s, d = by_id[s["parent"]], d + 1
        return d
    span_ms = (max(s["end_ns"] for s in trace) - t0) / 1e6
    fig, ax = plt.subplots(figsize=(10, 0.22 * len(trace) + 1.4), dpi=80)
    for i, s in enumerate(trace):  # bars at least 0.4% of the width: a 0.1 ms plan stays visible
        x, w = (s["start_ns"] - t0) / 1e6, max((s["end_ns"] - s["start_ns"]) / 1e6, span_ms / 250)
        ax.barh(i, w, left=x, color=COLORS.get(s["service"], "grey"), height=0.7)
        ax.text(x + w + 1, i, f"{(s['end_ns'] - s['start_ns']) / 1e6:.1f} ms", va="center", fontsize=6)
    ax.set_yticks(range(len(trace)), ["  " * depth(s) + s["name"].replace("nanokv.internal.v1.", "")
                                      for s in trace], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the API call's span started")
    fig.suptitle("One request (4 tokens) and the 4 step traces linked to it: spans from three processes",
                 fontsize=9)
    ax.legend(handles=[Patch(color=c, label=n) for n, c in COLORS.items()], fontsize=7, ncol=3,
              loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def draw_board(prom: Prometheus, t0: float, t1: float, path: Path, window_s: float = 10.0) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    board = json.loads(BOARD.read_text())
    panels = board["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) // 8
    fig, axes = plt.subplots(rows, 2, figsize=(11, 2.0 * rows), dpi=60, sharex=True, layout="constrained")
    used = {(p["gridPos"]["y"] // 8, 0 if p["gridPos"]["x"] < 12 else 1) for p in panels}
    for r in range(rows):
        for c in range(2):
            axes[r][c].set_visible((r, c) in used)
    for p in panels:
        ax = axes[p["gridPos"]["y"] // 8][0 if p["gridPos"]["x"] < 12 else 1]
        for t in p.get("targets", []):
            expr = re.sub(r"\[\d+[mh]\]", f"[{window_s:g}s]", t["expr"])  # the board's windows span minutes
            for series in prom.query_range(expr, t0, t1, 1.0):
                name = _legend(t.get("legendFormat", "") or t["expr"][:30], series["metric"])
                ax.plot([float(x) - t0 for x, _ in series["values"]], [float(v) for _, v in series["values"]],
                        label=name, linewidth=1.2)
        ax.set_title(p["title"], fontsize=9)
        ax.tick_params(labelsize=7)
        if ax.lines and len(ax.lines) <= 6:
            ax.legend(fontsize=6, loc="upper left")
        elif ax.lines:
            ax.text(0.01, 0.95, f"{len(ax.lines)} series", transform=ax.transAxes, fontsize=6, va="top")
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="grey")
    for ax in axes[-1]:
        ax.set_xlabel("seconds into the run", fontsize=7)
    fig.suptitle(f"Rendering of the Grafana board {board['title']!r} (matplotlib, not a screenshot): its PromQL "
                 f"answered by Prometheus over a {t1 - t0:.0f} s run, rate windows {window_s:.0f} s", fontsize=9)
    fig.savefig(path, dpi=60)
    plt.close(fig)


def _legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's legend format: {{label}} replaced by the series' value of that label."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: str(labels.get(m.group(1), "")), fmt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanokv_tools.bench.trace_png", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs", help="folder for trace.png and grafana-board.png")
    args = ap.parse_args(argv)
    print(json.dumps(run(Path(args.out))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
