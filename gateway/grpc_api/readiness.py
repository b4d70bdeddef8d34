"""grpc.health.v1 of the public gRPC API says what HTTP's /health and /ready say.

  service ""                              liveness, like GET /health: SERVING while the engine
                                          thread runs (a peer's outage included), NOT_SERVING once
                                          it has stopped
  "nanokv.v1.Generation",
  "inference.GRPCInferenceService"        readiness, like GET /ready: SERVING only while the gateway
                                          is attached to live cache and compute services
                                          (nanokv.gateway.recovery), NOT_SERVING during an outage

So a probe that restarts the gateway checks "", and a load balancer that routes requests checks the
service it sends them to. The statuses follow the engine within one poll interval.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from grpc_health.v1 import health_pb2

if TYPE_CHECKING:
    from nanokv.gateway.http.async_engine import AsyncEngine

log = logging.getLogger("nanokv.gateway.grpc")

POLL_S = 0.2
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def publish(health: Any, aengine: AsyncEngine, services: Sequence[str],
                  last: tuple[bool, bool] | None = None) -> tuple[bool, bool]:
    """Set the statuses from `aengine` (AsyncEngine) if they changed since `last`; returns them."""
    now = (aengine.healthy, aengine.ready)
    if now != last:
        await health.set("", SERVING if now[0] else NOT_SERVING)
        for name in services:
            await health.set(name, SERVING if now[1] else NOT_SERVING)
        if last is not None:
            log.info("gRPC health: live %s, ready %s", *now)
    return now


async def mirror(health: Any, aengine: AsyncEngine, services: Sequence[str], poll_s: float = POLL_S) -> None:
    """Run until cancelled: keep `health` (a grpc aio HealthServicer) in step with the engine."""
    last = await publish(health, aengine, services)
    while True:
        await asyncio.sleep(poll_s)
        last = await publish(health, aengine, services, last)
