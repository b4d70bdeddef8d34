"""The command line of `nanokv bench serve` (docs/bench-serve.md has what each flag is for)."""

from __future__ import annotations

import argparse

from nanokv.errors import NanoKVError
from nanokv_tools.bench.serve_launch import LAUNCH_COMMANDS
from nanokv_tools.bench.serve_workloads import WORKLOADS


def parse_rates(text: str, name: str = "request_rate") -> list[float]:
    """'1,2,inf' -> [1.0, 2.0, inf]; `name` is the flag's field in errors."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part.strip())
        except ValueError:
            raise NanoKVError(name, f"got {part!r}; allowed: numbers > 0 or inf, comma-separated") from None
        if not rate > 0:
            raise NanoKVError(name, f"got {part!r}; must be > 0")
        rates.append(rate)
    return rates


def parse_token_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi)
    except ValueError:
        raise NanoKVError("token_range", f"got {text!r}; expected LO:HI (token ids, LO < HI)") from None
    if not 0 <= a < b:
        raise NanoKVError("token_range", f"got {text!r}; expected 0 <= LO < HI")
    return a, b


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanokv bench serve", description="an online serving benchmark: TTFT, TPOT, "
                                "ITL, E2EL and throughputs per request rate, JSON and a plot")
    s = p.add_argument_group("server")
    s.add_argument("--backend", choices=("openai", "grpc"), default="openai",
                   help="openai: streamed /v1/completions over HTTP; grpc: streamed nanokv.v1 Generate")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the HTTP server's root")
    s.add_argument("--endpoint", default="/v1/completions")
    s.add_argument("--grpc-address", default="127.0.0.1:50051", help="HOST:PORT of the nanokv.v1 API")
    s.add_argument("--model", default=None, help="model name (default: the server's first in /v1/models)")
    s.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    s.add_argument("--launch", action="store_true", help="start the local stack on free ports for this run")
    s.add_argument("--launch-command", choices=LAUNCH_COMMANDS, default="up",
                   help="up: cache, compute and gateway as three processes; serve: one process")
    s.add_argument("--launch-args", default="", help="extra flags for the launched server, one string")
    s.add_argument("--launch-timeout-s", type=float, default=600.0)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="mooncake")
    w.add_argument("--trace", default=None, help="Mooncake JSONL (default: the vendored synthetic trace)")
    w.add_argument("--num-prompts", type=int, default=50, help="requests per rate")
    w.add_argument("--seed", type=int, default=0, help="the workload's shape and the arrival schedule")
    w.add_argument("--block-tokens", type=int, default=16, help="tokens per trace hash id sent")
    w.add_argument("--trace-block-tokens", type=int, default=512, help="tokens per hash id in the trace")
    w.add_argument("--max-input-tokens", type=int, default=None, help="cut longer trace prompts (whole blocks)")
    w.add_argument("--max-output-tokens", type=int, default=64, help="cap on every request's max_tokens")
    w.add_argument("--random-input-len", type=int, default=128)
    w.add_argument("--random-output-len", type=int, default=16, help="random: mean output; chat: mean answer")
    w.add_argument("--random-range-ratio", type=float, default=0.0)
    w.add_argument("--random-prefix-len", type=int, default=0, help="random: a prefix shared by every prompt")
    w.add_argument("--chat-turns", type=int, default=3)
    w.add_argument("--chat-systems", type=int, default=2, help="system prompts shared by the conversations")
    w.add_argument("--chat-system-len", type=int, default=64)
    w.add_argument("--chat-user-len", type=int, default=24, help="mean tokens of a user message")
    w.add_argument("--token-range", default="1000:30000", help="LO:HI, the token ids prompts are drawn from")
    w.add_argument("--cache-namespace", default=None,
                   help="seeds the prompts' content; each rate adds its own suffix (default: random per run, "
                        "so no run hits another's cached prefixes)")
    a = p.add_argument_group("arrivals and sampling")
    a.add_argument("--request-rates", "--request-rate", dest="request_rates", default="inf",
                   help="requests/s, comma-separated, each run in turn; inf: all at once")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    a.add_argument("--trace-timed", action="store_true", help="arrivals on the trace's own clock instead")
    a.add_argument("--trace-speedups", "--trace-speedup", dest="trace_speedups", default="1",
                   help="with --trace-timed: trace times are divided by each, comma-separated, in turn")
    a.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    a.add_argument("--temperature", type=float, default=0.0)
    a.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly max_tokens (servers without ignore_eos: --no-ignore-eos)")
    a.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    a.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one request before the first rate, not counted")
    a.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="bench_serve.json")
    o.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    o.add_argument("--no-plot", action="store_true")
    o.add_argument("--save-requests", action=argparse.BooleanOptionalAction, default=True,
                   help="per-request records in the JSON")
    return p
