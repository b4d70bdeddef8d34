"""`nanokv health ADDR`: one health check, for container health checks and scripts.

ADDR is a gRPC address (unix:/path.sock, HOST:PORT: grpc.health.v1 Check, SERVING or not) or an
http(s):// URL (the gateway's /health: a 200 answer). Exit codes: 0 healthy, 1 answering but not
healthy (a compute service still loading its model), 2 unreachable or no answer in time.

--ssl-* (nanokv.tls.ClientTLS) check a TLS server the way its clients reach it: the CA that signed it,
a client certificate where it requires one (mutual TLS), the name its certificate carries. That is the
probe of a pod whose gateway serves TLS only: a kubelet's own grpc probe speaks no TLS, and its https
probe presents no client certificate (deploy/k8s/components/tls).
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nanokv.errors import ConfigError
from nanokv.rpc import CHANNEL_OPTIONS, channel
from nanokv.tls import ClientTLS


def check(address: str, service: str = "", timeout_s: float = 3.0, tls: ClientTLS | None = None) -> tuple[int, str]:
    """(exit code, what was seen)."""
    if address.startswith(("http://", "https://")):
        if tls is not None and tls.server_name:
            raise ConfigError("ssl_server_name", "applies to a gRPC address; an https URL checks its own host name")
        ctx = tls.ssl_context() if tls is not None and address.startswith("https://") else None
        try:
            with urllib.request.urlopen(address, timeout=timeout_s, context=ctx) as r:  # noqa: S310 - operator's URL
                return (0 if r.status == 200 else 1), f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            return 1, f"HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            return 2, f"unreachable: {e}"
    ch = (channel(address) if tls is None else
          grpc.secure_channel(address, tls.grpc_credentials(), options=CHANNEL_OPTIONS + tls.grpc_options()))
    with ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                     timeout=timeout_s, wait_for_ready=False)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            return 2, f"{code.name if code is not None else 'error'}: {e.details() if hasattr(e, 'details') else e}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    return (0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1), name


def main(address: str, service: str, timeout_s: float, quiet: bool, tls: ClientTLS | None = None) -> int:
    if timeout_s <= 0:
        print("error: --timeout: must be > 0 seconds", file=sys.stderr)
        return 2
    code, seen = check(address, service, timeout_s, tls)
    if not quiet:
        print(f"{address}: {seen}", file=sys.stderr if code else sys.stdout)
    return code
