"""`nanokv health ADDR`: one health check, for container health checks and scripts.

ADDR is a gRPC address (unix:/path.sock, HOST:PORT: grpc.health.v1 Check, SERVING or not) or an
http(s):// URL (the gateway's /health: a 200 answer). Exit codes: 0 healthy, 1 answering but not
healthy (a compute service still loading its model), 2 unreachable or no answer in time.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nanokv.rpc import channel


def check(address: str, service: str = "", timeout_s: float = 3.0) -> tuple[int, str]:
    """(exit code, what was seen)."""
    if address.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(address, timeout=timeout_s) as r:  # noqa: S310 - the operator's URL
                return (0 if r.status == 200 else 1), f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            return 1, f"HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            return 2, f"unreachable: {e}"
    with channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                     timeout=timeout_s, wait_for_ready=False)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            return 2, f"{code.name if code is not None else 'error'}: {e.details() if hasattr(e, 'details') else e}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    return (0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1), name


def main(address: str, service: str, timeout_s: float, quiet: bool) -> int:
    if timeout_s <= 0:
        print("error: --timeout: must be > 0 seconds", file=sys.stderr)
        return 2
    code, seen = check(address, service, timeout_s)
    if not quiet:
        print(f"{address}: {seen}", file=sys.stderr if code else sys.stdout)
    return code
