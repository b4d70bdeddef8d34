"""Just enough PromQL to draw the Grafana board's panels from /metrics samples taken in this process
(nanokv_tools.bench.trace_png): a metric, rate(m[w]), sum/max/min/avg [by (labels)] (...), A / B and
histogram_quantile(q, ...), the forms nanokv/ops/grafana.json uses. Range windows are clamped to
`window_s` (a short run has no 5 minutes of history); anything else raises ValueError.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Series = dict[Labels, list[float]]  # one value per scrape (nan where the series was absent)


def scrape_table(texts: Sequence[str]) -> dict[str, Series]:
    """Exposition texts (one per scrape) -> sample name -> labels -> values over the scrapes."""
    table: dict[str, Series] = {}
    for i, text in enumerate(texts):
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                col = table.setdefault(s.name, {}).setdefault(tuple(sorted(s.labels.items())), [math.nan] * len(texts))
                col[i] = float(s.value)
    return table


def _split_top(expr: str, op: str) -> list[str] | None:
    depth = 0
    for i, ch in enumerate(expr):
        depth += ch == "("
        depth -= ch == ")"
        if ch == op and depth == 0:
            return [expr[:i], expr[i + 1:]]
    return None


def evaluate(expr: str, table: dict[str, Series], times: Sequence[float], window_s: float) -> Series:
    expr = expr.strip()
    parts = _split_top(expr, "/")
    if parts:
        a, b = (evaluate(p, table, times, window_s) for p in parts)
        if not a or not b:
            return {}
        if len(a) != 1 or len(b) != 1:
            raise ValueError(f"division of vectors with labels: {expr}")
        (la, va), (vb,) = next(iter(a.items())), b.values()
        return {la: [x / y if y else math.nan for x, y in zip(va, vb)]}
    m = re.fullmatch(r"histogram_quantile\(\s*([\d.]+)\s*,(.*)\)", expr, re.S)
    if m:
        return _quantile(float(m.group(1)), evaluate(m.group(2), table, times, window_s))
    m = re.fullmatch(r"(sum|max|min|avg)\s*(?:by\s*\(([^)]*)\)\s*)?\((.*)\)", expr, re.S)
    if m:
        keep = [k.strip() for k in (m.group(2) or "").split(",") if k.strip()]
        return _aggregate(m.group(1), keep, evaluate(m.group(3), table, times, window_s))
    m = re.fullmatch(r"rate\(\s*(\w+)\[\w+\]\s*\)", expr)
    if m:
        return {k: _rate(v, times, window_s) for k, v in table.get(m.group(1), {}).items()}
    if re.fullmatch(r"\w+", expr):
        return dict(table.get(expr, {}))
    raise ValueError(f"not in the PromQL subset: {expr}")


def _rate(values: list[float], times: Sequence[float], window_s: float) -> list[float]:
    out = []
    for i, t in enumerate(times):
        j = next((j for j in range(i + 1) if t - times[j] <= window_s), i)
        dt = t - times[j]
        out.append((values[i] - values[j]) / dt if dt > 0 and not math.isnan(values[j]) else math.nan)
    return out


def _aggregate(op: str, keep: list[str], series: Series) -> Series:
    groups: dict[Labels, list[list[float]]] = {}
    for labels, vals in series.items():
        key = tuple((k, v) for k, v in labels if k in keep)
        groups.setdefault(key, []).append(vals)
    out: Series = {}
    for key, rows in groups.items():
        col = []
        for column in zip(*rows):
            xs = [x for x in column if not math.isnan(x)]
            if not xs:
                col.append(math.nan)
            elif op == "sum":
                col.append(sum(xs))
            elif op == "avg":
                col.append(sum(xs) / len(xs))
            else:
                col.append(max(xs) if op == "max" else min(xs))
        out[key] = col
    return out


def _quantile(q: float, buckets: Series) -> Series:
    """Prometheus's histogram_quantile: linear within the bucket holding the q-th observation."""
    by_le = sorted(((float(dict(k)["le"]), v) for k, v in buckets.items()), key=lambda x: x[0])
    n = len(by_le[0][1]) if by_le else 0
    col = []
    for i in range(n):
        cum = [(le, v[i]) for le, v in by_le]
        total = cum[-1][1] if cum else math.nan
        if not cum or math.isnan(total) or total <= 0:
            col.append(math.nan)
            continue
        rank, lo_le, lo_c = q * total, 0.0, 0.0
        val = math.nan
        for le, c in cum:
            if c >= rank:
                val = lo_le if math.isinf(le) else lo_le + (le - lo_le) * (rank - lo_c) / max(c - lo_c, 1e-12)
                break
            lo_le, lo_c = le, c
        col.append(val)
    return {(): col}
