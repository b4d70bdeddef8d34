"""The gateway's side of a peer failure: end what was in flight, stay up, re-attach when the peers
are back.

A gateway attaches to the two services at start and after every outage:
  1. both answer grpc.health.v1 SERVING (the compute service only once it has mapped a pool);
  2. Cache.Release("") and Compute.Reset: whatever an earlier gateway, or this one before the outage,
     held goes (sequences, their blocks, the compute side's tables; steps count from 0 again);
  3. their settings agree with each other and with the gateway's (nanokv.agreement: block size, model,
     batch limits), and the gateway takes the cache service's (eviction policy, prefix caching) as its own;
  4. the compute service's pool epoch (ModelInfo.epoch) must equal the one the cache service has
     attached; plans and steps carry it from then on, so a peer that restarted in between rejects
     them with StaleEpoch instead of acting on a pool it never saw.

When a plan or step fails with ServiceUnavailable (peer gone: UNAVAILABLE at once, since the socket
closes; peer stalled: DEADLINE_EXCEEDED after rpc_timeout_s) or a PreconditionError (StaleEpoch:
a peer restarted), the engine's requests all end with that error, the gateway turns not-ready, and
attach is retried every RETRY_S until it succeeds. No torch here.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING

from nanokv.agreement import check_gateway
from nanokv.errors import PreconditionError, ServiceUnavailable
from nanokv.gateway.clients import CacheClient, ComputeClient
from nanokv.rpc import wait_serving

if TYPE_CHECKING:
    from nanokv.gateway.engine import Engine

log = logging.getLogger(__name__)
RETRY_S = 0.5
PROBE_TIMEOUT_S = 1.0  # a retry must not hold the engine thread: new requests wait on it meanwhile
PEER_ERRORS = (ServiceUnavailable, PreconditionError)


class Recovery:
    """The gRPC transport's attach and re-attach (the engine's cache and compute are these clients)."""

    def __init__(self, engine: Engine, cache: CacheClient, compute: ComputeClient):
        self.engine = engine
        self.cache = cache
        self.compute = compute
        self.gateway_id = uuid.uuid4().hex[:16]
        self.ready = False
        self.reason = "not attached yet"
        self.outages = 0
        self.reattaches = 0
        self._next_try = 0.0

    def attach(self, probe_timeout_s: float | None = None) -> None:
        """Steps 1-4 above; raises ServiceUnavailable (or a PreconditionError) while a peer is not back."""
        eng = self.engine
        cache, compute = self.cache, self.compute
        if probe_timeout_s is not None:
            for address in (cache.address, compute.address):
                try:
                    wait_serving(address, probe_timeout_s)
                except TimeoutError as e:
                    raise ServiceUnavailable(str(e)) from None
        cache.gateway_id = compute.gateway_id = self.gateway_id
        cache.release()  # every gateway's
        compute.reset()
        info = compute.info()
        cache_config, _ = cache.info()
        check_gateway(eng.config.gateway, cache_config, info)  # nanokv.agreement: a mismatch is refused
        eng.config = eng.config.with_sections(cache=cache_config)  # the gateway runs by the cache's settings
        attached = cache.stats()["attached_epoch"]
        if not info.epoch or info.epoch != attached:
            raise ServiceUnavailable(f"the compute service's pool (epoch {info.epoch}) is not the cache "
                                     f"service's ({attached}): a peer is re-attaching")
        if (info.name, info.num_blocks, info.block_size) != (eng.model_name, eng.num_blocks,
                                                             eng.model_info.block_size):
            raise ServiceUnavailable(f"the compute service came back with another model or pool ({info.name}, "
                                     f"{info.num_blocks} blocks); restart the gateway")
        cache.epoch = compute.epoch = info.epoch
        eng.attached(info)
        self.ready, self.reason = True, ""

    def on_failure(self, exc: BaseException) -> list[str]:
        """A peer failed: every request ends (their ids are returned); not ready until attach works."""
        eng = self.engine
        self.outages += 1
        self.ready, self.reason = False, f"{type(exc).__name__}: {exc}"
        ended = eng.drop_all_requests()
        log.warning("a service failed (%s): ending %d requests, re-attaching", self.reason, len(ended))
        self._next_try = 0.0
        return ended

    def try_attach(self) -> bool:
        """One rate-limited, short attempt (the engine thread calls it while not ready)."""
        now = time.monotonic()
        if self.ready or now < self._next_try:
            return self.ready
        self._next_try = now + RETRY_S
        try:
            self.attach(PROBE_TIMEOUT_S)
        except PEER_ERRORS as e:
            self.reason = f"re-attaching: {type(e).__name__}: {e}"
            return False
        self.reattaches += 1
        log.warning("re-attached to the services (pool epoch %d)", self.engine.model_info.epoch)
        return True
