"""The numbers of `nanokv bench serve`, named and computed as vLLM's serving benchmark does.

Per request: TTFT (sent to first output chunk), E2EL (sent to end of stream), TPOT ((E2EL - TTFT) /
(output tokens - 1), requests with more than one output token only) and ITL (every gap between two
successive output chunks, pooled over the requests). Each as mean, median (p50), std, p90 and p99 in
ms; percentiles interpolate linearly between order statistics (numpy's default). Throughputs divide
by the run's duration (first request due to last response done). Failed requests count only as
failures. Prefix hit ratio: prompt tokens the server reported as cached / prompt tokens.
"""

from __future__ import annotations

import math
from typing import Any

from nanokv.errors import NanoKVError
from nanokv_tools.bench.serve_clients import Record

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2el")


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between the order statistics (numpy.percentile's default)."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values_s]
    mean = sum(ms) / len(ms) if ms else 0.0
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)) if ms else 0.0
    out = {f"mean_{name}_ms": mean, f"median_{name}_ms": percentile(ms, 50), f"std_{name}_ms": std}
    out.update({f"p{p}_{name}_ms": percentile(ms, p) for p in PERCENTILES})
    return out


def tpot_s(r: Record) -> float | None:
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`ttft:500 tpot:50` (ms) -> {"ttft": 500.0, "tpot": 50.0}."""
    out: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS:
            raise NanoKVError("goodput", f"got {item!r}; allowed keys: {', '.join(SLO_KEYS)} (KEY:MILLISECONDS)")
        try:
            out[key] = float(value)
        except ValueError:
            raise NanoKVError("goodput", f"got {item!r}; the value must be a number of milliseconds") from None
        if out[key] <= 0:
            raise NanoKVError("goodput", f"got {item!r}; the value must be > 0 ms")
    return out


def _meets(r: Record, slo: dict[str, float]) -> bool:
    got = {"ttft": r.ttft_s, "tpot": tpot_s(r) or 0.0, "e2el": r.e2e_s}
    return all(got[k] * 1000.0 <= v for k, v in slo.items())


def summarize(records: list[Record], duration_s: float, slo: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    d = max(duration_s, 1e-9)
    out: dict[str, Any] = {
        "duration": duration_s, "completed": len(ok), "failed": len(records) - len(ok),
        "total_input_tokens": n_in, "total_output_tokens": n_out, "cached_prompt_tokens": cached,
        "prefix_hit_ratio": cached / n_in if n_in else 0.0,
        "request_throughput": len(ok) / d, "output_throughput": n_out / d, "total_token_throughput": (n_in + n_out) / d,
    }
    if slo:
        out["request_goodput"] = sum(_meets(r, slo) for r in ok) / d
    out.update(_stats("ttft", [r.ttft_s for r in ok]))
    out.update(_stats("tpot", [t for r in ok if (t := tpot_s(r)) is not None]))
    out.update(_stats("itl", [g for r in ok for g in r.itl_s]))
    out.update(_stats("e2el", [r.e2e_s for r in ok]))
    return out


def rate_label(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


def run_label(rate: float, trace_timed: bool) -> str:
    """A table row's name: the offered rate, or `x2` for the trace's clock twice as fast."""
    return f"x{rate:g}" if trace_timed else rate_label(rate)


HEADER = (f"{'rate':>6} {'ok/fail':>8} {'req/s':>7} {'out tok/s':>9} {'tot tok/s':>9} {'TTFT p50/p90/p99 ms':>21} "
          f"{'TPOT p50/p90/p99 ms':>21} {'ITL p50/p99 ms':>15} {'E2EL p50/p99 ms':>17} {'hit':>6}")


def table_row(label: str, s: dict[str, Any]) -> str:
    def trio(m: str) -> str:
        return "/".join(f"{s[f'{k}_{m}_ms']:.0f}" for k in ("median", "p90", "p99"))

    itl = f"{s['median_itl_ms']:.0f}/{s['p99_itl_ms']:.0f}"
    e2e = f"{s['median_e2el_ms']:.0f}/{s['p99_e2el_ms']:.0f}"
    return (f"{label:>6} {s['completed']:>4}/{s['failed']:<3} {s['request_throughput']:>7.2f} "
            f"{s['output_throughput']:>9.1f} {s['total_token_throughput']:>9.1f} {trio('ttft'):>21} "
            f"{trio('tpot'):>21} {itl:>15} {e2e:>17} {s['prefix_hit_ratio']:>6.1%}")


def plot(runs: list[dict[str, Any]], path: str, title: str) -> None:
    """TTFT and TPOT (p50, p99) and output throughput against the achieved request throughput, one
    point per request rate (labelled with the offered rate: `inf` has no place on a rate axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["summary"]["request_throughput"] for r in runs]
    labels = [r["label"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, metric, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        for p, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(xs, [r["summary"][f"{p}_{metric}_ms"] for r in runs], style, label=f"{name} {p}")
        ax.set_ylabel(f"{name} (ms)")
    axes[2].plot(xs, [r["summary"]["output_throughput"] for r in runs], "o-", label="output tok/s")
    axes[2].plot(xs, [r["summary"]["total_token_throughput"] for r in runs], "s--", label="total tok/s")
    axes[2].set_ylabel("tokens/s")
    for ax in axes:
        ax.set_xlabel("achieved request throughput (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        for x, lab, y in zip(xs, labels, ax.get_lines()[0].get_ydata()):
            text = lab if lab.startswith("x") else f"rate {lab}"
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
