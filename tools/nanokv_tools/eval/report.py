"""The eval's printed table (one row per setting, the full-precision reference first)."""

from __future__ import annotations

from typing import Any


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _phase(row: dict[str, Any]) -> str:
    """The peak shown: over the perplexity windows when there were any, else over the passkey prompts."""
    return "perplexity" if "perplexity" in (row.get("peak_kv_bytes") or {}) else "passkey"


def table(result: dict[str, Any]) -> str:
    lengths = result.get("passkey_lengths") or []
    head = ["setting", "bytes/tok", "% bf16", "peak MiB", "vs bf16", "vs dense", "drop mean", "drop end",
            "demote mean", "demote end", "PPL", "dPPL %", "KL mean", "KL p99.9", "top-1"]
    head += [f"pk@{L}" for L in lengths]
    rows = [head]
    for r in result["settings"]:
        p = r.get("perplexity") or {}
        pk = r.get("passkey") or {}
        phase = _phase(r)
        peak = (r.get("peak_kv_bytes") or {}).get(phase)
        mean = (r.get("mean_fraction") or {}).get(phase) or {}
        end = (r.get("end_fraction") or {}).get(phase) or {}
        rows.append([
            r["name"], _fmt(r["bytes_per_token"], ".0f"), _fmt(r["pct_of_bf16"], ".1f"),
            _fmt(None if peak is None else peak / 2**20, ".2f"), _fmt((r.get("peak_vs_bf16") or {}).get(phase), ".3f"),
            _fmt((r.get("peak_vs_dense") or {}).get(phase), ".3f"),
            _fmt(mean.get("dropped"), ".3f"), _fmt(end.get("dropped"), ".3f"),
            _fmt(mean.get("demoted"), ".3f"), _fmt(end.get("demoted"), ".3f"),
            _fmt(p.get("ppl"), ".4f"), _fmt(p.get("delta_ppl_pct"), "+.3f"), _fmt(p.get("kl_mean"), ".5f"),
            _fmt(p.get("kl_p999"), ".4f"), _fmt(p.get("top1_agreement"), ".4f"),
            *[_fmt(pk.get(str(L)), ".2f") for L in lengths],
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    note = (f"{result['tokens']} tokens scored from {result['corpus']} (context {result['context']}, "
            f"chunk {result['chunk']}); passkey: accuracy over {result.get('passkey_trials', 0)} prompts "
            f"per length (fp row = full-precision cache on the same prompts); peak MiB = most live KV one "
            f"sequence held (perplexity windows, else passkey prompts), vs bf16 = over the reference's counted "
            f"as bf16, vs dense = over its dense setting's; drop / demote = fraction of full blocks dropped / "
            f"held as INT4, mean over every step and at each sequence's end (the budget's steady state)")
    return "\n".join(lines + [note])
