"""`nanokv router`: flags, and the process (the HTTP front under uvicorn, the gRPC front on the same
event loop, started and stopped by the HTTP app's lifespan, as a gateway's are)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import AsyncIterator

from nanokv.errors import NanoKVError
from nanokv.router.replica import parse_replica, parse_replicas
from nanokv.router.routing import POLICIES
from nanokv.tls import ClientTLS, add_server_tls_args, server_tls

API_KEY_ENV = "NANOKV_API_KEY"  # (the gateway's: the router and its replicas share keys)


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address of both fronts (default loopback)")
    p.add_argument("--port", type=int, default=8000, help="the OpenAI HTTP API")
    p.add_argument("--grpc-port", type=int, default=50051, help="nanokv.v1, KServe v2 and grpc.health.v1; 0 = off")
    p.add_argument("--replicas", default="", metavar="HOST:HTTP_PORT:GRPC_PORT[,...]",
                   help="the replicas' gateways (their public ports)")
    p.add_argument("--replicas-dns", default=None, metavar="NAME:HTTP_PORT:GRPC_PORT",
                   help="a name whose every address is a replica, resolved each health interval (a headless Service)")
    p.add_argument("--routing", default="kv", choices=POLICIES,
                   help="kv: the longest cached prefix, weighed against load; round_robin: in turn")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' (the replicas' keys: the caller's key goes on to "
                        f"them and salts its tenant's prefixes); repeatable; also ${API_KEY_ENV}, comma-separated")
    p.add_argument("--health-interval-s", type=float, default=2.0,
                   help="seconds between a replica's health checks (and DNS lookups)")
    p.add_argument("--load-weight", type=float, default=0.25,
                   help="kv routing: blocks of prefill one running or waiting sequence is worth")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_server_tls_args(p.add_argument_group("TLS of the router's own ports"), "the router")
    rt = p.add_argument_group("TLS to the replicas (nanokv.tls)")
    rt.add_argument("--replica-tls", action="store_true",
                    help="reach the replicas over TLS (implied by any --replica-ssl-* flag)")
    rt.add_argument("--replica-ssl-ca-certs", default=None, metavar="PEM",
                    help="CA bundle that signed the replicas' certificates (default: the system's roots)")
    rt.add_argument("--replica-ssl-certfile", default=None, metavar="PEM",
                    help="the router's client certificate, for replicas that require one (mutual TLS)")
    rt.add_argument("--replica-ssl-keyfile", default=None, metavar="PEM", help="its private key")
    rt.add_argument("--replica-ssl-server-name", default=None, metavar="NAME",
                    help="the name the replicas' certificates carry (default: each replica's host as given; set it "
                         "with --replicas-dns, whose replicas are reached by address)")


def _keys(args: argparse.Namespace) -> list[str]:
    keys = list(args.api_key or [])
    return keys + [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]


def router_main(args: argparse.Namespace) -> int:
    import uvicorn

    from nanokv.gateway.http.cli import grpc_address
    from nanokv.router.grpc_proxy import start_grpc
    from nanokv.router.http_app import build_router_app
    from nanokv.router.service import RouterService

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per forwarded request otherwise)
    static = parse_replicas(args.replicas)
    dns = None
    if args.replicas_dns:
        a = parse_replica(args.replicas_dns, "replicas_dns")
        dns = (a.host, a.http_port, a.grpc_port)
    if not static and dns is None:
        raise NanoKVError("replicas", "give --replicas HOST:HTTP_PORT:GRPC_PORT[,...] or --replicas-dns")
    if not args.health_interval_s > 0:
        raise NanoKVError("health_interval_s", f"got {args.health_interval_s}; must be > 0")
    try:
        address = grpc_address(args.host, args.grpc_port)
    except ValueError as e:
        raise NanoKVError("grpc_port", str(e)) from None
    tls = server_tls(args)
    replica_tls = ClientTLS.build(args.replica_tls, args.replica_ssl_ca_certs, args.replica_ssl_certfile,
                                  args.replica_ssl_keyfile, args.replica_ssl_server_name)
    svc = RouterService(static, dns, policy=args.routing, api_keys=_keys(args),
                        health_interval_s=args.health_interval_s, load_weight=args.load_weight, tls=replica_tls)
    app = build_router_app(svc)

    @contextlib.asynccontextmanager
    async def lifespan(_: object) -> AsyncIterator[None]:
        await svc.start()
        server = None
        if address is not None:
            server, _port = await start_grpc(svc, address, tls.grpc_credentials() if tls else None)
        logging.getLogger("nanokv.router").info(
            "routing (%s) over %d replicas%s: HTTP%s on %s:%d, gRPC on %s", args.routing, len(svc.pool.replicas),
            " (TLS)" if replica_tls else "", "S" if tls else "", args.host, args.port, address or "(off)")
        try:
            yield
        finally:
            if server is not None:
                await server.stop(2.0)
            await svc.stop()
            await app.state.client.aclose()

    app.router.lifespan_context = lifespan
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=30,
                **(tls.uvicorn_kwargs() if tls else {}))
    return 0
