"""`nanokv serve` (and `up`, `gateway`): argparse wiring for the server.

Engine flags are generated from the config's fields (`block_size` -> `--block-size`, nanokv.flags):
EngineConfig's for `serve` and `up`, which run every service; GatewayConfig's for `gateway`, whose
cache and compute services run with their own. Flags left out are not passed at all: defaults live
in the config classes only.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

from nanokv.config import EngineConfig
from nanokv.errors import NanoKVError
from nanokv.flags import add_config_args, engine_kwargs
from nanokv.gateway.http.defaults import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING
from nanokv.tls import ServerTLS, add_server_tls_args, server_tls

API_KEY_ENV = "NANOKV_API_KEY"


def add_serve_args(parser: argparse.ArgumentParser, config_cls: type = EngineConfig,
                   exclude: tuple[str, ...] = (), helps: dict[str, str] | None = None, tls: bool = True) -> None:
    """tls: also the --ssl-* flags (nanokv.tls), for both of the API's ports."""
    srv = parser.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1",
                     help="bind address (default loopback; exposing the server needs --api-key)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--grpc-port", type=int, default=50051,
                     help="the public gRPC API (nanokv.v1 and KServe v2) on --host; 0 = off")
    srv.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help=f"require 'Authorization: Bearer KEY'; repeat for several tenants, each with its "
                          f"own prefix cache (also read from ${API_KEY_ENV}, comma-separated)")
    srv.add_argument("--served-model-name", default=None, help="model id clients send (default: the model's)")
    srv.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                     help="requests allowed to wait for a batch slot; past it clients get 429 + Retry-After")
    srv.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                     help="larger request bodies get 413")
    srv.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    if tls:
        add_server_tls_args(srv, "the API")

    add_config_args(parser, config_cls, exclude, helps)


def _api_keys(args: argparse.Namespace) -> list[str]:
    keys = list(args.api_key or [])
    keys += [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    return keys


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def grpc_address(host: str, port: int) -> str | None:
    if port < 0 or port > 65535:
        raise ValueError(f"--grpc-port: got {port}; allowed: 1 to 65535, or 0 (off)")
    if port == 0:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def serve_main(args: argparse.Namespace) -> int:
    import uvicorn

    from nanokv.gateway.engine import Engine
    from nanokv.gateway.http.app import build_app

    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=args.log_level.upper(), format=fmt)
    log = logging.getLogger("nanokv.gateway.http")
    try:
        config = EngineConfig.from_kwargs(**engine_kwargs(args))
    except NanoKVError as e:
        print(f"nanokv serve: error: --{e.field.replace('_', '-')}: {e.message}", file=sys.stderr)
        return 2
    try:
        tls: ServerTLS | None = server_tls(args) if hasattr(args, "ssl_certfile") else None
    except NanoKVError as e:
        print(f"nanokv serve: error: --{e.field.replace('_', '-')}: {e.message}", file=sys.stderr)
        return 2
    keys = _api_keys(args)
    if not keys and not _is_loopback(args.host):
        log.warning("serving on %s without --api-key: anyone who can reach this port can use it", args.host)
    engine = Engine(config)
    try:
        app = build_app(engine, api_key=keys or None, max_waiting=args.max_waiting,
                        max_body_bytes=args.max_body_bytes, served_model_name=args.served_model_name,
                        grpc_address=grpc_address(args.host, args.grpc_port),
                        grpc_credentials=tls.grpc_credentials() if tls else None)
    except ValueError as e:
        print(f"nanokv serve: error: {e}", file=sys.stderr)
        return 2
    scheme = "https" if tls else "http"
    log.info("serving %s on %s://%s:%d/v1%s", app.state.model_info.name, scheme, args.host, args.port,
             f" ({tls.describe()})" if tls else "")
    if args.grpc_port:
        log.info("gRPC API on %s:%d%s", args.host, args.grpc_port, " (TLS)" if tls else "")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=30,
                **(tls.uvicorn_kwargs() if tls else {}))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (`python -m nanokv.gateway.http.cli`) until `nanokv serve` is wired."""
    parser = argparse.ArgumentParser(prog="nanokv serve", description="OpenAI-compatible server")
    add_serve_args(parser)
    return serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
