"""`nanokv` command line.

  generate | serve | bench | simulate | eval      (serve, generate: services in this process)
  cache | compute | gateway | up                  the services as separate processes (docs/services.md)
  soak [--minutes N]                              faults under load: the services as processes, a compute restart
  health ADDR                                     one grpc.health.v1 (or HTTP /health) check: exit 0 if healthy
  router --replicas H:P:G,...                     one front for many replicas, KV-aware (docs/router.md)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from nanokv.cache_service.policies import policy_help
from nanokv.errors import NanoKVError
from nanokv.sparsity import budget_help


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine config flags shared by the subcommands (names map 1:1 to EngineConfig keys)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    g.add_argument("--dtype", default=None)
    g.add_argument("--device", default=None)
    g.add_argument("--weight-quantization", default=None, help="auto, none or gguf (docs/cpu-decode.md)")
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--num-gpu-blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--eviction-policy", default=None, help=policy_help())
    g.add_argument("--enable-compression", action="store_true", default=None)
    g.add_argument("--quantization-bitwidth", default=None, help="8, 4, or a JSON per-layer plan")
    g.add_argument("--compression-sparsity", type=float, default=None,
                   help="block sparsity s in [0, 1), 0 = off (the default). " + budget_help())
    g.add_argument("--sparsity-policy", default=None)
    g.add_argument("--sparsity-options", default=None,
                   help="block sparsity's knobs 'name=value,...' (sink_blocks, recent_blocks, min_ranked, score_mode, "
                        "store_fraction, probe_window)")
    g.add_argument("--enforce-eager", action="store_true", default=None)
    g.add_argument("--batch-invariant", action="store_true", default=None)
    g.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false", default=None)
    g.add_argument("--tensor-parallel-size", type=int, default=None)
    g.add_argument("--attention-backend", default=None)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    g.add_argument("--adaptive", action="store_true", default=None)
    g.add_argument("--kernel-options", default=None, help="Triton kernel overrides 'name=value,...' (A/B runs)")


ENGINE_KEYS = ("model", "dtype", "device", "weight_quantization", "block_size", "num_gpu_blocks",
               "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "eviction_policy",
               "enable_compression", "quantization_bitwidth", "compression_sparsity", "sparsity_policy",
               "sparsity_options", "enforce_eager", "batch_invariant", "tensor_parallel_size", "attention_backend",
               "enable_prefix_caching", "adaptive", "kernel_options")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ENGINE_KEYS if getattr(args, k, None) is not None}


# commands of the separate nanokv-tools distribution, found through its entry points (group
# nanokv.commands): the engine never imports its tools
TOOL_COMMANDS = {
    "bench": "throughput benchmarks (prints numbers, writes JSON)",
    "soak": "a bounded mixed run against the three services, a compute restart in it",
    "simulate": "replay a trace through the cache manager",
    "eval": "quality of KV compression settings",
}


def run_tool(name: str, argv: list[str]) -> int:
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="nanokv.commands") if ep.name == name]
    if not found:
        print(f"error: `nanokv {name}` is one of the tools, in the nanokv-tools distribution, which is not "
              "installed here: pip install -e tools (from a nanokv checkout)", file=sys.stderr)
        return 2
    try:
        return int(found[0].load()(argv) or 0)
    except NanoKVError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_generate(args: argparse.Namespace) -> int:
    from nanokv.gateway.llm import LLM

    kw = engine_kwargs(args)
    if not args.split:
        return _generate(args, LLM(**kw))
    from nanokv.config import EngineConfig
    from nanokv.launch import start_services

    with start_services(EngineConfig.from_kwargs(**kw).to_dict()) as svc:
        llm = LLM(**kw, cache_address=svc.cache_address, compute_address=svc.compute_address)
        try:
            return _generate(args, llm)
        finally:
            llm.engine.shutdown()


def _generate(args: argparse.Namespace, llm: Any) -> int:
    from nanokv.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    prompts = args.prompt
    if args.raw:
        outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    else:
        ids = [llm.engine.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        outs = llm.generate(ids, params, use_tqdm=len(prompts) > 1)
    if args.json:
        print(json.dumps([{
            "prompt": p, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
            "error": o.error, "num_cached_tokens": o.num_cached_tokens,
            "ttft_s": (o.metrics.first_token_time - o.metrics.arrival_time) if o.metrics.first_token_time else None,
            "e2e_s": (o.metrics.finish_time - o.metrics.arrival_time) if o.metrics.finish_time else None,
        } for p, o in zip(prompts, outs)], indent=2))
    else:
        for o in outs:
            print(o.text if o.error is None else f"error: {o.error}")
    return 0 if all(o.error is None for o in outs) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanokv", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate a reply with the chat template")
    g.add_argument("prompt", nargs="+")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--json", action="store_true")
    g.add_argument("--split", action="store_true",
                   help="through the services in separate processes: cache and compute are started for it")
    add_engine_args(g)

    from nanokv.flags import add_config_args
    from nanokv.gateway.http.cli import add_serve_args
    from nanokv.service_config import CacheConfig, ComputeConfig, GatewayConfig

    # each service's flags are its own config's (nanokv.service_config); `up` and `serve` take them all
    c = sub.add_parser("cache", help="the cache service (gRPC): blocks, prefix hashes, eviction, KV storage")
    c.add_argument("--listen", default="127.0.0.1:50061", help="unix:/path.sock or HOST:PORT (default loopback)")
    # each policy with its caveat; block sparsity's budget (s is not reached on short sequences)
    helps = {"eviction_policy": policy_help(), "compression_sparsity": "block sparsity, 0 = off. " + budget_help()}
    add_config_args(c, CacheConfig, helps=helps)
    m = sub.add_parser("compute", help="the compute service (gRPC): the model, forward pass, sampling")
    m.add_argument("--listen", default="127.0.0.1:50062", help="unix:/path.sock or HOST:PORT (default loopback)")
    m.add_argument("--cache", required=True, help="the cache service's address")
    add_config_args(m, ComputeConfig, helps={"compression_sparsity": helps["compression_sparsity"]})
    gw = sub.add_parser("gateway", help="the gateway: HTTP API and scheduler, on running cache/compute services")
    gw.add_argument("--cache", required=True, help="the cache service's address")
    gw.add_argument("--compute", required=True, help="the compute service's address")
    gw.add_argument("--wait-s", type=float, default=0.0,
                    help="wait up to this long for the cache and compute services to be SERVING (start-up order)")
    add_serve_args(gw, GatewayConfig, exclude=("cache_address", "compute_address"))  # (--cache, --compute)
    h = sub.add_parser("health", help="check a service's health (grpc.health.v1, or an http:// /health URL)")
    h.add_argument("address", help="unix:/path.sock, HOST:PORT, or http://HOST:PORT/health")
    h.add_argument("--service", default="", help="grpc.health.v1 service name (default: the server overall)")
    h.add_argument("--timeout", type=float, default=3.0, help="seconds")
    h.add_argument("-q", "--quiet", action="store_true")
    h.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                   help="check a TLS server: the CA that signed its certificate (default: the system's roots)")
    h.add_argument("--ssl-certfile", default=None, metavar="PEM", help="a client certificate (mutual TLS)")
    h.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the client certificate's key")
    h.add_argument("--ssl-server-name", default=None, help="the name the server's certificate carries "
                   "(default: the host dialled)")
    h.add_argument("--tls", action="store_true", help="TLS with the system's roots and no client certificate")
    up = sub.add_parser("up", help="start cache, compute and gateway locally (unix sockets) and serve HTTP")
    up.add_argument("--run-dir", default=None, help="where the sockets, service logs and pids.json go (default: a "
                    "temp dir, removed at the end); the services are restarted when they exit (docs/operating.md)")
    add_serve_args(up, helps=helps)

    from nanokv.router.cli import add_router_args
    r = sub.add_parser("router", help="route requests over replicas (gateways) by cached prefix and load")
    add_router_args(r)

    for name, what in TOOL_COMMANDS.items():  # their flags are their own: the rest of the line goes to them
        t = sub.add_parser(name, help=f"{what} (nanokv-tools)", add_help=False)
        t.add_argument("rest", nargs=argparse.REMAINDER)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(s, helps=helps)

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOL_COMMANDS:
        return run_tool(argv[0], argv[1:])
    args = parser.parse_args(argv)
    try:
        if args.cmd == "generate":
            return cmd_generate(args)
        if args.cmd == "serve":
            from nanokv.gateway.http.cli import serve_main
            return int(serve_main(args) or 0)
        if args.cmd == "health":
            from nanokv.health import main as health_main
            from nanokv.tls import ClientTLS
            tls = ClientTLS.build(args.tls, args.ssl_ca_certs, args.ssl_certfile, args.ssl_keyfile,
                                  args.ssl_server_name, prefix="ssl")
            return health_main(args.address, args.service, args.timeout, args.quiet, tls)
        if args.cmd == "up":  # supervises the three as child processes (nanokv.supervise)
            from nanokv.launch import up_main
            return up_main(args, argv[1:])
        if args.cmd == "router":
            from nanokv.router.cli import router_main
            return router_main(args)
        if args.cmd in ("cache", "compute", "gateway"):
            return _service_main(args)
    except NanoKVError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1


def _service_main(args: argparse.Namespace) -> int:
    import logging

    from nanokv import tracing
    from nanokv.flags import service_config
    from nanokv.gateway.http.cli import serve_main

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tracing.set_role(args.cmd if args.cmd in ("cache", "compute") else "gateway")  # service.name by default
    if args.cmd == "cache":  # (its own config, from its own flags)
        from nanokv.cache_service.server import serve as serve_cache
        serve_cache(service_config(args), args.listen)
        return 0
    if args.cmd == "compute":
        from nanokv.compute_service.server import serve as serve_compute
        serve_compute(service_config(args), args.listen, args.cache)
        return 0
    if args.cmd == "gateway":
        if args.wait_s > 0:
            from nanokv.rpc import wait_serving
            for address in (args.cache, args.compute):
                wait_serving(address, args.wait_s)
        args.cache_address, args.compute_address = args.cache, args.compute
        return int(serve_main(args) or 0)
    raise ValueError(f"not a service: {args.cmd}")  # `up`: nanokv.launch.up_main


if __name__ == "__main__":
    sys.exit(main())
