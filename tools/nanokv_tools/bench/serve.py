"""`nanokv bench serve`: an online serving benchmark against a running server (docs/bench-serve.md).

    nanokv bench serve --base-url http://127.0.0.1:8000 --workload mooncake --request-rates 1,2,4,inf
    nanokv bench serve --backend grpc --grpc-address 127.0.0.1:50051 --workload chat
    nanokv bench serve --launch --launch-args "--num-gpu-blocks 512" --workload random

For each request rate in turn: requests arrive on a seeded Poisson (or gamma, --burstiness) schedule,
or on the trace's own clock (--trace-timed), at most --max-concurrency at once; each streams its
output. It prints one table row per rate (TTFT, TPOT, ITL, E2EL percentiles, throughputs, prefix hit
ratio), and writes one JSON (per-rate summaries and per-request records) and a latency-against-rate
PNG. Also `python -m nanokv_tools.bench.serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import platform
import re
import sys
import time
import urllib.request
import uuid
from typing import Any

from nanokv.errors import NanoKVError
from nanokv_tools.bench import serve_report as report
from nanokv_tools.bench.serve_args import build_parser, parse_rates, parse_token_range
from nanokv_tools.bench.serve_clients import Record, grpc_request, openai_request
from nanokv_tools.bench.serve_launch import launch
from nanokv_tools.bench.serve_workloads import TokenSource, arrival_times, build_shapes, render_prompt


def _model_name(base_url: str, api_key: str | None) -> str:
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return str(json.load(r)["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise NanoKVError("model", f"could not read {base_url}/v1/models ({e}); pass --model") from None


async def _grpc_model_name(stub: Any, api_key: str | None, target: str) -> str:
    import grpc

    from nanokv.protos import nanokv_v1_pb2 as pb
    try:
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30,
                                       metadata=(("authorization", f"Bearer {api_key}"),) if api_key else None)
    except grpc.RpcError as e:
        raise NanoKVError("grpc_address", f"GetModelInfo on {target} failed: {e.code()} {e.details()}") from None
    return str(info.name)


async def run_rate(args: argparse.Namespace, shapes: list, rate: float, namespace: str, send: Any) -> dict[str, Any]:
    """One pass over `shapes` at `rate` (with --trace-timed, `rate` is the trace speedup)."""
    lo, hi = parse_token_range(args.token_range)
    src = TokenSource(namespace, lo, hi)
    trace_s = [s.timestamp_s for s in shapes] if args.trace_timed else None
    due = arrival_times(len(shapes), rate, seed=args.seed, burstiness=args.burstiness, trace_s=trace_s,
                        trace_speedup=rate)
    records = [Record(i, 0, s.max_tokens, scheduled_s=due[i], conv=s.conv, turn=s.turn) for i, s in enumerate(shapes)]
    prompts: list[list[int]] = [[] for _ in shapes]
    done = [asyncio.Event() for _ in shapes]
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        try:
            await asyncio.sleep(max(0.0, t0 + due[i] - time.perf_counter()))
            shape, rec = shapes[i], records[i]
            parent = shape.parent
            if parent is not None:  # a chat turn goes once the previous turn has answered
                await done[parent].wait()
            prompts[i] = render_prompt(shape, i, src, args.block_tokens, args.random_prefix_len,
                                       prompts[parent] if parent is not None else None,
                                       records[parent].output_tokens if parent is not None else 0)
            rec.prompt_len = len(prompts[i])
            async with sem or contextlib.nullcontext():
                await send(rec, prompts[i], t0=t0)
        finally:
            done[i].set()

    await asyncio.gather(*(one(i) for i in range(len(shapes))))
    duration = time.perf_counter() - t0
    slo = report.parse_goodput(args.goodput)
    label = {"trace_speedup": rate} if args.trace_timed else {"request_rate": report.rate_label(rate)}
    return {**label, "label": report.run_label(rate, args.trace_timed), "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency, "cache_namespace": namespace,
            "summary": report.summarize(records, duration, slo), "records": records}


async def run_all(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    rates = parse_rates(args.trace_speedups, "trace_speedup") if args.trace_timed else parse_rates(args.request_rates)
    report.parse_goodput(args.goodput)
    parse_token_range(args.token_range)
    if args.trace_timed and args.workload in ("random", "chat"):
        raise NanoKVError("trace_timed", f"the {args.workload} workload has no clock; use mooncake or conversation")
    shapes = build_shapes(args.workload, num_prompts=args.num_prompts, seed=args.seed,
                          max_output_tokens=args.max_output_tokens, block_tokens=args.block_tokens, trace=args.trace,
                          trace_block_tokens=args.trace_block_tokens, max_input_tokens=args.max_input_tokens,
                          input_len=args.random_input_len, output_len=args.random_output_len,
                          range_ratio=args.random_range_ratio, chat_turns=args.chat_turns,
                          chat_systems=args.chat_systems, chat_system_len=args.chat_system_len,
                          chat_user_len=args.chat_user_len)
    common = dict(api_key=args.api_key, temperature=args.temperature, ignore_eos=args.ignore_eos,
                  timeout_s=args.timeout_s)
    if not shapes:
        raise NanoKVError("num_prompts", f"the {args.workload} workload gave no requests")
    channel = None
    send: Any
    if args.backend == "grpc":
        import grpc

        from nanokv.protos import nanokv_v1_pb2_grpc as pb_grpc
        channel = grpc.aio.insecure_channel(args.grpc_address)
        stub = pb_grpc.GenerationStub(channel)
        send = functools.partial(grpc_request, stub=stub, **common)
        target = args.grpc_address
        args.model = args.model or await _grpc_model_name(stub, args.api_key, target)
    else:
        args.model = args.model or _model_name(args.base_url, args.api_key)
        url = args.base_url.rstrip("/") + args.endpoint
        send = functools.partial(openai_request, url=url, model=args.model, **common)
        target = url
    namespace = args.cache_namespace or uuid.uuid4().hex[:12]
    log(f"{args.backend} {target}; workload {args.workload}, {len(shapes)} requests per rate, "
        f"{'trace speedups' if args.trace_timed else 'rates'} {', '.join(report.rate_label(r) for r in rates)}")
    runs = []
    try:
        if args.warmup:
            rec = Record(-1, 0, min(shapes[0].max_tokens, 8))
            first = shapes[0] if shapes[0].parent is None else dataclasses.replace(shapes[0], parent=None)
            prompt = render_prompt(first, 0, TokenSource(f"{namespace}/warmup", *parse_token_range(args.token_range)),
                                   args.block_tokens, args.random_prefix_len)
            rec.prompt_len = len(prompt)
            await send(rec, prompt, t0=time.perf_counter())
            if not rec.success:
                raise NanoKVError("base_url" if args.backend == "openai" else "grpc_address",
                                  f"the warm-up request to {target} failed: {rec.error}")
        log(report.HEADER)
        for k, rate in enumerate(rates):
            run = await run_rate(args, shapes, rate, f"{namespace}/{k}", send)
            log(report.table_row(run["label"], run["summary"]))
            runs.append(run)
    finally:
        if channel is not None:
            await channel.close()
    return {"backend": args.backend, "target": target, "model": args.model, "cache_namespace": namespace,
            "runs": runs}


def _json_ready(result: dict[str, Any], save_requests: bool) -> dict[str, Any]:
    out = dict(result)
    out["runs"] = [{**{k: v for k, v in run.items() if k != "records"},
                    **({"requests": [dataclasses.asdict(r) for r in run["records"]]} if save_requests else {})}
                   for run in result["runs"]]
    return out


def main(argv: list[str] | None = None, log: Any = print) -> int:
    args = build_parser().parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.launch:
            served = stack.enter_context(launch(args.launch_command, args.launch_args, args.launch_timeout_s, log))
            args.base_url, args.grpc_address = served.base_url, served.grpc_address
        result = asyncio.run(run_all(args, log))
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "plot", "no_plot")}
    # keys never go into results that get shared
    settings["api_key"] = "<set>" if args.api_key else None
    settings["launch_args"] = re.sub(r"(--api-key[ =])\S+", r"\1<set>", args.launch_args)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "cpu_count": os.cpu_count(),
              "args": settings, **_json_ready(result, args.save_requests)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {args.out}")
    if not args.no_plot and result["runs"]:
        png = args.plot or os.path.splitext(args.out)[0] + ".png"
        report.plot(result["runs"], png, f"nanokv bench serve: {args.backend}, {args.workload}, "
                    f"{args.num_prompts} requests per rate ({result['model'] or result['target']})")
        log(f"wrote {png}")
    return 0 if all(r["summary"]["failed"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except NanoKVError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
