"""The PromQL subset behind docs/grafana-board.png: every panel of nanokv/ops/grafana.json is in it,
and rate, aggregation, division and histogram_quantile give the numbers Prometheus would."""

from __future__ import annotations

import json

import pytest
from nanokv_tools.bench.promql_lite import evaluate, scrape_table
from nanokv_tools.bench.trace_png import BOARD

T0 = """# TYPE req_total counter
req_total{reason="stop"} 10
req_total{reason="length"} 5
# TYPE lat_seconds histogram
lat_seconds_bucket{le="0.1"} 0
lat_seconds_bucket{le="1.0"} 0
lat_seconds_bucket{le="+Inf"} 0
lat_seconds_sum 0
lat_seconds_count 0
"""
T1 = (T0.replace(" 10\n", " 30\n").replace('le="0.1"} 0', 'le="0.1"} 10').replace('le="1.0"} 0', 'le="1.0"} 30')
      .replace('le="+Inf"} 0', 'le="+Inf"} 40').replace("sum 0", "sum 20").replace("count 0", "count 40"))


def test_subset_numbers():
    table = scrape_table([T0, T1])
    times = [0.0, 10.0]

    def at_end(expr):
        return {dict(k).get("reason"): v[-1] for k, v in evaluate(expr, table, times, 60).items()}
    assert at_end("sum by (reason) (rate(req_total[5m]))") == {"stop": 2.0, "length": 0.0}
    assert at_end("sum(rate(req_total[5m]))") == {None: 2.0}
    assert at_end("max(req_total)") == {None: 30.0}
    # bucket rates 1, 3, 4 /s: the median lies in (0.1, 1.0], 1/2 of the way in; p99 in +Inf: the last bound
    assert at_end("histogram_quantile(0.5, sum by (le) (rate(lat_seconds_bucket[5m])))")[None] == pytest.approx(0.55)
    assert at_end("histogram_quantile(0.99, sum by (le) (rate(lat_seconds_bucket[5m])))")[None] == 1.0
    assert at_end("sum(rate(lat_seconds_sum[5m])) / sum(rate(lat_seconds_count[5m]))") == {None: 0.5}
    with pytest.raises(ValueError, match="not in the PromQL subset"):
        evaluate("increase(req_total[5m])", table, times, 60)


def test_every_board_expression_is_in_the_subset():
    board = json.loads(BOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    for e in exprs:
        evaluate(e, scrape_table([T0, T1]), [0.0, 10.0], 60)  # raises ValueError outside the subset
