"""What one `nanokv router` can drive: requests/s through a real router process in front of stand-in
replicas that answer at once (so the router's own cost, tokenizing, hashing, scoring, forwarding, is
what is measured, not a model's).

    python -m nanokv_tools.bench.router_bench [--replicas 2] [--concurrency 32] [--seconds 20] [--out r.json]

A stand-in replica is a process serving what a router uses of a gateway: grpc.health.v1, GetServerInfo,
KvEvents (an empty snapshot, then quiet; GetRoutingInfo hands over the embedded model's tokenizer) and
/v1/chat/completions answering a fixed two-token reply. The load is chat requests of about 100 prompt
tokens, each conversation distinct, sent by `--concurrency` clients for `--seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

from nanokv_tools.bench import write_json


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the stand-in replica (its own process) -------------------------------------------------------------
def stub_replica(http_port: int, grpc_port: int) -> None:
    import grpc
    import uvicorn
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from nanokv.model_files import load_tokenizer
    from nanokv.protos import kv_events_pb2 as ev
    from nanokv.protos import kv_events_pb2_grpc as ev_grpc
    from nanokv.protos import nanokv_v1_pb2 as pb
    from nanokv.protos import nanokv_v1_pb2_grpc as pb_grpc

    with tempfile.TemporaryDirectory() as d:
        load_tokenizer(None).save_pretrained(d)  # (a GGUF tokenizer: transformers reads it with torch)
        files = {n: open(os.path.join(d, n), "rb").read() for n in os.listdir(d)}

    class Events(ev_grpc.KvEventsServicer):
        async def Subscribe(self, request, context):  # type: ignore[no-untyped-def]
            yield ev.KvEventBatch(stream_id="stub", snapshot=True, block_size=16, hash_algo="sha256",
                                  events=[ev.KvEvent(cleared=ev.AllBlocksCleared())])
            await asyncio.Event().wait()  # quiet until the router hangs up

        async def GetRoutingInfo(self, request, context):  # type: ignore[no-untyped-def]
            return ev.RoutingInfo(block_size=16, tokenizer_files=files, model="stub")

    class Gen(pb_grpc.GenerationServicer):
        async def GetServerInfo(self, request, context):  # type: ignore[no-untyped-def]
            return pb.ServerInfo(ready=True, kv_blocks_total=1000, kv_blocks_free=1000)

    reply = {"id": "x", "object": "chat.completion", "created": 0, "model": "stub",
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok ok"}, "finish_reason": "length"}],
             "usage": {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102,
                       "prompt_tokens_details": {"cached_tokens": 0}}}

    async def chat(request):  # type: ignore[no-untyped-def]
        await request.body()
        return JSONResponse(reply)

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])

    async def main() -> None:
        server = grpc.aio.server()
        ev_grpc.add_KvEventsServicer_to_server(Events(), server)
        pb_grpc.add_GenerationServicer_to_server(Gen(), server)
        hs = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        server.add_insecure_port(f"127.0.0.1:{grpc_port}")
        await server.start()
        await hs.set("nanokv.v1.Generation", health_pb2.HealthCheckResponse.SERVING)
        await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=http_port, log_level="warning")).serve()

    asyncio.run(main())


# ---- the load ------------------------------------------------------------------------------------------
async def drive(url: str, concurrency: int, seconds: float) -> dict:
    import httpx

    latencies: list[float] = []
    errors = 0
    stop = time.monotonic() + seconds
    filler = " ".join(f"word{i}" for i in range(40))

    async def client(c: int) -> None:
        nonlocal errors
        async with httpx.AsyncClient(timeout=30) as http:
            n = 0
            while time.monotonic() < stop:
                body = {"model": "stub", "max_tokens": 2, "temperature": 0, "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": f"Client {c} question {n}: {filler}"}]}
                t = time.perf_counter()
                try:
                    r = await http.post(url, json=body)
                    r.raise_for_status()
                    latencies.append(time.perf_counter() - t)
                except httpx.HTTPError:
                    errors += 1
                n += 1

    t0 = time.monotonic()
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    wall = time.monotonic() - t0
    lat = sorted(latencies)
    return {"requests": len(lat), "errors": errors, "seconds": round(wall, 2),
            "requests_per_s": round(len(lat) / wall, 1),
            "latency_p50_ms": round(1e3 * statistics.median(lat), 2) if lat else None,
            "latency_p99_ms": round(1e3 * lat[int(0.99 * (len(lat) - 1))], 2) if lat else None}


def _wait_http(url: str, timeout_s: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="router_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--routing", default="kv", choices=("kv", "round_robin"))
    p.add_argument("--out", default=None)
    p.add_argument("--stub-replica", nargs=2, type=int, metavar=("HTTP_PORT", "GRPC_PORT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stub_replica:
        stub_replica(*args.stub_replica)
        return 0
    procs = []
    try:
        specs = []
        for _ in range(args.replicas):
            h, g = _free_port(), _free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "nanokv_tools.bench.router_bench",
                                           "--stub-replica", str(h), str(g)]))
            specs.append(f"127.0.0.1:{h}:{g}")
        rh, rg = _free_port(), _free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "nanokv.cli", "router", "--port", str(rh),
                                       "--grpc-port", str(rg), "--replicas", ",".join(specs), "--routing",
                                       args.routing, "--log-level", "warning"]))
        _wait_http(f"http://127.0.0.1:{rh}/ready")
        asyncio.run(drive(f"http://127.0.0.1:{rh}/v1/chat/completions", 2, 2.0))  # warm: tokenizer, connections
        result = {"replicas": args.replicas, "concurrency": args.concurrency, "routing": args.routing,
                  "cpus": os.cpu_count(),
                  "router": asyncio.run(drive(f"http://127.0.0.1:{rh}/v1/chat/completions", args.concurrency,
                                              args.seconds)),
                  "one_stub_direct": asyncio.run(drive(f"http://{specs[0].rsplit(':', 1)[0]}/v1/chat/completions",
                                                       args.concurrency, min(args.seconds, 10.0)))}
        print(result)
        write_json(args.out, result)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
