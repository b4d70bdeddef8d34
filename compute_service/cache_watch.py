"""The compute service watches the cache service it attached to, and follows its restarts.

A thread holds a grpc.health.v1 Watch stream on the cache service. When the stream reports
NOT_SERVING, or breaks (the process died: the socket closes at once; a hung host: the channel's
keepalive gives up within ~15 s) and a Stats call no longer finds our pool attached there (a
stream can also end while its server lives on), the compute service stops serving, drops every
view of the old segment (ModelRunner.release_pool; steps now fail with StaleEpoch, never touch
stale memory) and forgets every sequence (their blocks lived in that pool). It then waits for a
cache service to answer again, attaches a new pool (a new epoch), maps it and serves again. The
gateway notices the new epoch and re-attaches itself (nanokv.gateway.recovery).
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nanokv.kv.monitor import CompressionMonitor
from nanokv.protos import internal_pb2 as pb
from nanokv.protos import internal_pb2_grpc as pb_grpc
from nanokv.rpc import channel, wait_serving

log = logging.getLogger("nanokv.compute_service")
RETRY_S = 0.5
PROBE_TIMEOUT_S = 1.0


class CacheWatch:
    def __init__(self, cache_address: str, servicer: Any, attach_pool: Callable[..., Any],
                 set_serving: Callable[[bool], None], stop: threading.Event, timeout_s: float):
        self.cache_address = cache_address
        self.servicer = servicer  # ComputeServicer: its svc and its step turn (a lock steps hold)
        self.attach_pool = attach_pool
        self.set_serving = set_serving
        self.stop = stop
        self.timeout_s = timeout_s
        self.reattaches = 0
        self.thread = threading.Thread(target=self._run, name="nanokv-cache-watch", daemon=True)

    def start(self) -> CacheWatch:
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.is_set():
            reason = self._watch()
            if self.stop.is_set():
                return
            if not reason.startswith("health ") and self._still_ours():
                # the stream broke but its server lives on with our pool (e.g. a GOAWAY): not an outage
                log.info("health watch on %s ended (%s); the pool is still attached: watching again",
                         self.cache_address, reason)
                self.stop.wait(0.1)
                continue
            log.warning("cache service %s lost (%s): releasing the KV pool", self.cache_address, reason)
            self._release()
            self._reattach()

    def _watch(self) -> str:
        """Block while the cache service serves; return why it stopped."""
        try:
            with channel(self.cache_address) as ch:
                stream = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
                for resp in stream:
                    if self.stop.is_set():
                        return "stopping"
                    if resp.status != health_pb2.HealthCheckResponse.SERVING:
                        return f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
                return "watch stream ended"
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}" if hasattr(e, "code") else str(e)

    def _still_ours(self) -> bool:
        """Does the cache service still answer, with the pool this process maps attached?"""
        epoch = getattr(self.servicer.svc.runner, "pool_epoch", 0)
        try:
            with channel(self.cache_address) as ch:
                stats = pb_grpc.CacheStub(ch).Stats(pb.Empty(), timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError:
            return False
        return bool(epoch) and stats.attached_epoch == epoch

    def _release(self) -> None:
        self.set_serving(False)
        svc = self.servicer.svc
        with self.servicer.turn:  # no step runs while the views go
            svc.runner.release_pool()
            svc.drop_sequences()
            svc.compression_monitor = CompressionMonitor()
            gc.collect()  # the old segment's mapping goes with its last view

    def _reattach(self) -> None:
        while not self.stop.is_set():
            try:
                wait_serving(self.cache_address, 5.0)
                svc = self.servicer.svc
                with self.servicer.turn:
                    svc.runner.remap_pool(self.attach_pool)
                    svc.compression_monitor = CompressionMonitor().attach(svc.runner.layer_hooks)
                self.reattaches += 1
                log.info("re-attached to the cache service: pool epoch %d", svc.runner.pool_epoch)
                self.set_serving(True)
                return
            except Exception as e:  # noqa: BLE001 - keep trying until the cache service is back
                log.info("cache service not back yet (%s)", e)
                self.stop.wait(RETRY_S)
