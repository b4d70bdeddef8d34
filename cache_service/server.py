"""`nanokv cache`: the cache service as a gRPC server (nanokv.internal.v1.Cache + grpc.health.v1).

The servicer only translates: every call goes to the same CacheService object LLM() uses in
process. The pool is allocated in shared memory (the compute service maps it), and is removed
when the server stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from nanokv.agreement import Mismatch, check_attach
from nanokv.cache_service.kv_events_rpc import KvEventsServicer
from nanokv.cache_service.segments import remove_orphans
from nanokv.cache_service.service import CacheService, NotAttached
from nanokv.lease import start_reaper
from nanokv.messages import CacheServiceStats
from nanokv.protos import codec, kv_events_pb2_grpc
from nanokv.protos import internal_pb2 as pb
from nanokv.protos import internal_pb2_grpc as pb_grpc
from nanokv.rpc import add_servicer, make_server, rpc_errors, set_serving, stop_on_signals
from nanokv.service_config import CacheConfig
from nanokv.service_metrics import ServiceMetrics

log = logging.getLogger("nanokv.cache_service")
SERVICE_NAME = "nanokv.internal.v1.Cache"


class CacheServicer(pb_grpc.CacheServicer):
    def __init__(self, svc: CacheService, config: CacheConfig):
        self.svc = svc
        self.config = config

    def Info(self, request: pb.Empty, context: Any) -> pb.CacheInfo:
        with rpc_errors(context):
            return codec.cache_info_to_pb(*self.svc.info())

    def Attach(self, request: pb.AttachRequest, context: Any) -> pb.PoolHandle:
        with rpc_errors(context):
            layout = codec.layout_from_pb(request.layout)
            if request.HasField("terms"):  # refused before anything changes: the pool stays as it was
                terms = codec.terms_from_pb(request.terms)
                try:
                    check_attach(self.config, terms)
                except Mismatch as e:
                    log.warning("attach refused: %s", e)
                    raise
                self.svc.attached_model = terms.model
            handle = self.svc.attach(layout)
            log.info("pool attached: %d blocks, %d bytes, epoch %d (%s)", layout.num_blocks, handle.nbytes,
                     handle.epoch, handle.path or handle.kind)
            return codec.handle_to_pb(handle)

    def Detach(self, request: pb.DetachRequest, context: Any) -> pb.Empty:
        with rpc_errors(context):
            self.svc.detach(request.epoch)
            log.info("pool of epoch %d detached", request.epoch)
            return pb.Empty()

    def Plan(self, request: pb.PlanRequest, context: Any) -> pb.PlanReply:
        with rpc_errors(context, failed_precondition=(NotAttached,)):
            return codec.plan_reply_to_pb(self.svc.plan(codec.plan_request_from_pb(request)))

    def Stats(self, request: pb.Empty, context: Any) -> pb.CacheStats:
        with rpc_errors(context, failed_precondition=(NotAttached,)):
            return codec.cache_stats_to_pb(self.svc.stats())

    def ResetPrefixCache(self, request: pb.ResetRequest, context: Any) -> pb.Empty:
        with rpc_errors(context, failed_precondition=(NotAttached,)):
            self.svc.reset_prefix_cache(clear_stats=request.clear_stats)
            return pb.Empty()

    def GhostWindow(self, request: pb.Empty, context: Any) -> pb.GhostWindowReply:
        with rpc_errors(context, failed_precondition=(NotAttached,)):
            return codec.ghost_window_to_pb(self.svc.ghost_window())

    def RestartGhosts(self, request: pb.Empty, context: Any) -> pb.Empty:
        with rpc_errors(context, failed_precondition=(NotAttached,)):
            self.svc.restart_ghosts()
            return pb.Empty()

    def SetPolicy(self, request: pb.SetPolicyRequest, context: Any) -> pb.Empty:
        with rpc_errors(context, failed_precondition=(NotAttached,)):
            self.svc.set_policy(request.policy)
            log.info("eviction policy switched to %s", request.policy)
            return pb.Empty()

    def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.Empty:
        with rpc_errors(context):
            self.svc.release(request.gateway_id or None)  # (it logs how many sequences ended)
            return pb.Empty()


def serve(config: CacheConfig, listen: str, stop: threading.Event | None = None) -> None:
    remove_orphans()  # segments of a cache service that was killed (cache_service/segments.py)
    svc = CacheService(config, shared=True, ghosts=True)
    if config.device != "cpu":
        _init_cuda()
    metrics = _metrics(svc)
    server, hs = make_server(listen)
    add_servicer(server, metrics.instrument(CacheServicer(svc, config), pb.DESCRIPTOR.services_by_name["Cache"]),
                 "Cache", pb)
    kv_events_pb2_grpc.add_KvEventsServicer_to_server(  # type: ignore[no-untyped-call]  # (generated, untyped)
        KvEventsServicer(svc.events), server)  # (for a router)
    metrics.serve(config.metrics_port, config.metrics_host)
    server.start()
    set_serving(hs, [SERVICE_NAME], True)
    log.info("cache service on %s (policy %s)", listen, config.eviction_policy)
    stop = stop or threading.Event()
    start_reaper(svc.leases, svc.release, stop)  # a dead gateway's sequences go (nanokv.lease)
    stop_on_signals(stop)
    try:
        stop.wait()
    finally:
        set_serving(hs, [SERVICE_NAME], False)
        server.stop(grace=2.0).wait()
        metrics.close()
        svc.close()


def _metrics(svc: CacheService) -> ServiceMetrics:
    """The service's own /metrics, with the pool's occupancy (zeros until a compute service attaches)."""
    m = ServiceMetrics()

    def read(pick: Callable[[CacheServiceStats], float]) -> Callable[[], float]:
        def value() -> float:
            try:
                return float(pick(svc.stats()))
            except NotAttached:
                return 0.0
        return value
    m.gauge("nanokv_cache_pool_blocks", "KV blocks in the attached pool.", read(lambda s: s["kv_blocks_total"]))
    m.gauge("nanokv_cache_pool_free_blocks", "KV blocks free (cached blocks included: they can be evicted).",
            read(lambda s: s["kv_blocks_free"]))
    m.gauge("nanokv_cache_pool_cached_blocks", "KV blocks holding a reusable prefix.",
            read(lambda s: s["kv_blocks_cached"]))
    m.gauge("nanokv_cache_pool_sequences", "Sequences holding blocks.", read(lambda s: s["num_seqs"]))
    return m


def _init_cuda() -> None:
    """Create this process's CUDA context now, before the compute service sizes the pool from the
    device's free memory (the context's few hundred MiB would otherwise appear after it measured)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.init()  # type: ignore[no-untyped-call]  # (torch leaves it unannotated)
        torch.zeros(1, device="cuda")
