"""`nanokv compute`: the compute service as a gRPC server (nanokv.internal.v1.Compute + health).

At start it loads the model and attaches to the cache service's KV pool (Cache.Attach: the
layout goes out, a shared-memory handle comes back and is mapped once); health turns SERVING
when the first step could run. Steps are taken strictly in step_id order: a step that arrives
early (a pipelining gateway sends step N+1 before it reads step N's tokens) waits for its turn,
then launches as soon as step N has launched, and its reply waits only for its own tokens.
"""

from __future__ import annotations

import gc
import logging
import threading
from typing import Any

from nanokv import tracing
from nanokv.agreement import pool_terms
from nanokv.compute_service.cache_watch import CacheWatch
from nanokv.compute_service.service import ComputeService
from nanokv.compute_service.validate import validate_step
from nanokv.errors import PreconditionError
from nanokv.lease import Leases, start_reaper
from nanokv.messages import ModelInfo, PoolHandle, PoolLayout
from nanokv.protos import codec
from nanokv.protos import internal_pb2 as pb
from nanokv.protos import internal_pb2_grpc as pb_grpc
from nanokv.rpc import (
    add_servicer,
    call,
    channel,
    make_server,
    rpc_errors,
    set_serving,
    stop_on_signals,
    wait_serving,
)
from nanokv.service_config import ComputeConfig
from nanokv.service_metrics import ServiceMetrics
from nanokv.trace_grpc import intercept_channel

log = logging.getLogger("nanokv.compute_service")
SERVICE_NAME = "nanokv.internal.v1.Compute"


class ComputeServicer(pb_grpc.ComputeServicer):
    def __init__(self, step_timeout_s: float, lease_s: float = 180.0, config: ComputeConfig | None = None):
        self._svc: ComputeService | None = None  # set once the model is loaded and the pool attached
        self.turn = threading.Condition()
        self.step_timeout_s = step_timeout_s
        self.leases = Leases(lease_s)  # the gateway's: a dead one's sequences go (nanokv.lease)
        self.config = config or ComputeConfig()

    def _info(self, info: ModelInfo) -> pb.ModelInfo:
        """ModelInfo with the batch this service sized its buffers for (the gateway checks its own against it)."""
        info.max_num_seqs = self.config.max_num_seqs
        info.max_num_batched_tokens = self.config.max_num_batched_tokens
        return codec.info_to_pb(info)

    @property
    def svc(self) -> ComputeService:
        if self._svc is None:
            raise LookupError("the compute service is still starting (loading the model)")
        return self._svc

    def Info(self, request: pb.Empty, context: Any) -> pb.ModelInfo:
        with rpc_errors(context):
            return self._info(self.svc.info())

    def GetTokenizer(self, request: pb.Empty, context: Any) -> pb.TokenizerFiles:
        with rpc_errors(context):
            return pb.TokenizerFiles(files=self.svc.tokenizer_files())

    def Step(self, request: pb.StepRequest, context: Any) -> pb.StepResult:
        with rpc_errors(context):
            req = codec.step_request_from_pb(request)
            validate_step(self.svc, req, in_turn=False)
            self.leases.renew(req.gateway_id)
            with self.turn:
                if not self.turn.wait_for(lambda: self.svc._next_step >= req.step_id, self.step_timeout_s):
                    raise PreconditionError("step_id", f"step {req.step_id}: step {self.svc._next_step} never came "
                                                       f"within {self.step_timeout_s:g} s")
                validate_step(self.svc, req)  # whole, before its deltas change any table
                launched = self.svc.launch(req)
                self.turn.notify_all()
            return codec.step_result_to_pb(self.svc.collect(launched))

    def Stats(self, request: pb.Empty, context: Any) -> pb.ComputeStats:
        with rpc_errors(context):
            return codec.compute_stats_to_pb(self.svc.stats())

    def ResetStats(self, request: pb.Empty, context: Any) -> pb.Empty:
        with rpc_errors(context):
            self.svc.reset_stats()
            return pb.Empty()

    def Repool(self, request: pb.RepoolRequest, context: Any) -> pb.ModelInfo:
        with rpc_errors(context):
            with self.turn:  # no step runs while the views of the old segment go
                info = self.svc.repool(request.num_blocks or None, list(request.layer_bits) or None)
                self.turn.notify_all()
            return self._info(info)

    def ProbeErrors(self, request: pb.Empty, context: Any) -> pb.ProbeErrorsReply:
        with rpc_errors(context):
            with self.turn:  # between steps: the probe's sums are written by the forward pass
                errors = self.svc.probe_errors()
            return codec.probe_errors_to_pb(errors)

    def Reset(self, request: pb.Empty, context: Any) -> pb.Empty:
        with rpc_errors(context):
            with self.turn:
                self.svc.reset()
                self.turn.notify_all()
            self.leases.drop()
            return pb.Empty()

    def release_gateway(self, gateway_id: str) -> None:
        """The gateway's lease ran out: its sequences' tables and sampler state go."""
        with self.turn:
            self.svc.drop_sequences()


def attach_via(cache_address: str, timeout_s: float, config: ComputeConfig | None = None):  # noqa: ANN201
    """ComputeService's attach_pool over gRPC: the cache service allocates, we map its handle. With
    `config`, every attach carries this service's PoolTerms: the cache service refuses a pool whose
    block size or configured KV format is not its own (nanokv.agreement)."""
    def attach(layout: PoolLayout) -> PoolHandle:
        wait_serving(cache_address, timeout_s)
        req = pb.AttachRequest(layout=codec.layout_to_pb(layout))
        if config is not None:
            model = config.model or "SmolLM2-135M-Instruct"  # (ComputeService.model_name)
            req.terms.CopyFrom(codec.terms_to_pb(pool_terms(config, len(layout.layer_bits), model)))
        with tracing.span("nanokv.compute.attach_pool", {"nanokv.num_blocks": layout.num_blocks}), \
                intercept_channel(channel(cache_address)) as ch:
            reply = call(pb_grpc.CacheStub(ch).Attach, req, timeout_s, "attach")
        return codec.handle_from_pb(reply)
    return attach


def serve(config: ComputeConfig, listen: str, cache_address: str, stop: threading.Event | None = None) -> None:
    server, hs = make_server(listen)
    servicer = ComputeServicer(config.rpc_timeout_s, config.gateway_lease_s, config)
    metrics = ServiceMetrics()  # up while the model loads: a scrape tells loading from gone
    add_servicer(server, metrics.instrument(servicer, pb.DESCRIPTOR.services_by_name["Compute"]), "Compute", pb)
    metrics.serve(config.metrics_port, config.metrics_host)
    set_serving(hs, [SERVICE_NAME], False)
    server.start()  # health answers NOT_SERVING while the model loads
    attach = attach_via(cache_address, config.rpc_timeout_s, config)
    try:  # (a refused attach, nanokv.agreement, ends here: the process exits with its message)
        svc = servicer._svc = ComputeService(config, attach_pool=attach, error_probe=True)
    except BaseException:
        server.stop(grace=None)
        raise
    set_serving(hs, [SERVICE_NAME], True)
    log.info("compute service on %s: %s, %d KV blocks (cache service %s)", listen, svc.model_name,
             svc.runner.num_blocks, cache_address)
    stop = stop or threading.Event()
    start_reaper(servicer.leases, servicer.release_gateway, stop)
    if getattr(svc.runner, "follows_cache_pool", True):  # (not torchrun's ranks: they allocate their own)
        CacheWatch(cache_address, servicer, attach, lambda ok: set_serving(hs, [SERVICE_NAME], ok), stop,
                   config.rpc_timeout_s).start()
    stop_on_signals(stop)
    try:
        stop.wait()
    finally:
        set_serving(hs, [SERVICE_NAME], False)
        server.stop(grace=2.0).wait()
        metrics.close()
        svc.close()
        _detach(cache_address, svc, config.rpc_timeout_s)


def _detach(cache_address: str, svc: ComputeService, timeout_s: float) -> None:
    """Drop this process's mapping of the pool, then tell the cache service (it may reuse the segment
    for the next compute service; it never frees memory that a live mapping still points at)."""
    handle = getattr(svc.runner, "pool_handle", None)
    if handle is None:
        return
    svc.runner.graphs = None
    svc.runner.kv_caches = []
    vars(svc).pop("compression_monitor", None)  # it holds the layers too
    gc.collect()
    try:
        with channel(cache_address) as ch:
            call(pb_grpc.CacheStub(ch).Detach, pb.DetachRequest(epoch=handle.epoch), min(timeout_s, 5.0), "detach")
    except Exception as e:  # the cache service may be gone first: nothing is attached there any more
        log.info("detach from the cache service: %s", e)
