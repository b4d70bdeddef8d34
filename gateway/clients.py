"""The gRPC transport: clients of the cache and compute services with the in-process API.

CacheClient and ComputeClient answer the same calls as CacheService and ComputeService, so the
engine cannot tell them apart; every call has a deadline (EngineConfig.rpc_timeout_s). Plans and
steps carry the gateway's id (its lease) and the pool epoch it attached to (nanokv.gateway.recovery
sets both), so a restarted peer rejects them rather than acting on stale state. A step's
launch sends the request and returns the call's future; collect waits for it, which is what lets
a pipelining gateway plan step N+1 while the compute service runs step N. Both implement the
Protocols of nanokv.service_api.
"""

from __future__ import annotations

import time
from typing import Any

import grpc

from nanokv.messages import (
    CacheServiceStats,
    ComputeServiceStats,
    GhostScores,
    ModelInfo,
    PlanReply,
    PlanRequest,
    StepRequest,
    StepResult,
)
from nanokv.protos import codec
from nanokv.protos import internal_pb2 as pb
from nanokv.protos import internal_pb2_grpc as pb_grpc
from nanokv.rpc import call, channel, remote_error, wait_serving
from nanokv.service_api import PendingPlan, PendingStep
from nanokv.service_config import CacheConfig
from nanokv.trace_grpc import intercept_channel

STARTUP_TIMEOUT_S = 120.0


class PlanFuture:
    """A plan on the wire (CacheAPI.plan_async): wait() reads its reply."""

    def __init__(self, future: Any, client: CacheClient):  # future: grpc.Future (grpc ships no types)
        self.future = future
        sent = time.perf_counter()

        def done(_: object) -> None:  # (a gRPC thread) the round trip, hidden or not
            client.plan_rtt_s += time.perf_counter() - sent
        future.add_done_callback(done)

    def wait(self) -> PlanReply:
        try:
            return codec.plan_reply_from_pb(self.future.result())
        except grpc.RpcError as e:
            raise remote_error(e, "plan") from None


class StepFuture:
    """A step on the wire (ComputeAPI.launch): wait() reads its sampled tokens."""

    def __init__(self, future: Any):  # grpc.Future
        self.future = future

    def wait(self) -> StepResult:
        try:
            return codec.step_result_from_pb(self.future.result())
        except grpc.RpcError as e:
            raise remote_error(e, "step") from None


class CacheClient:
    """nanokv.service_api.CacheAPI over gRPC."""

    def __init__(self, address: str, timeout_s: float):
        self.address = address
        self.timeout = timeout_s
        wait_serving(address, timeout_s)
        self.channel = intercept_channel(channel(address))  # the step span's traceparent goes along
        self.stub = pb_grpc.CacheStub(self.channel)  # type: ignore[no-untyped-call]  # (generated, untyped)

    gateway_id = ""  # set by nanokv.gateway.recovery at attach
    epoch = 0
    plan_rtt_s = 0.0  # plans sent ahead: send to reply, summed (Engine.stats reports it)

    def plan(self, request: PlanRequest) -> PlanReply:
        request.epoch, request.gateway_id = self.epoch, self.gateway_id
        return codec.plan_reply_from_pb(call(self.stub.Plan, codec.plan_request_to_pb(request), self.timeout, "plan"))

    def plan_async(self, request: PlanRequest) -> PendingPlan:
        """The plan sent now, its reply read later (async scheduling plans the next step ahead)."""
        request.epoch, request.gateway_id = self.epoch, self.gateway_id
        return PlanFuture(self.stub.Plan.future(codec.plan_request_to_pb(request), timeout=self.timeout), self)

    def stats(self) -> CacheServiceStats:
        return codec.cache_stats_from_pb(call(self.stub.Stats, pb.Empty(), self.timeout, "stats"))

    def info(self) -> tuple[CacheConfig, str]:
        """The cache service's config, and the model of the compute service attached ("": none)."""
        return codec.cache_info_from_pb(call(self.stub.Info, pb.Empty(), self.timeout, "info"))

    def reset_prefix_cache(self, clear_stats: bool = False) -> None:
        call(self.stub.ResetPrefixCache, pb.ResetRequest(clear_stats=clear_stats), self.timeout, "reset")

    def ghost_window(self) -> tuple[GhostScores, GhostScores] | None:
        """The adaptive policy rule's evidence (CacheService.ghost_window), once a window."""
        return codec.ghost_window_from_pb(call(self.stub.GhostWindow, pb.Empty(), self.timeout, "ghost_window"))

    def restart_ghosts(self) -> None:
        call(self.stub.RestartGhosts, pb.Empty(), self.timeout, "restart_ghosts")

    def set_policy(self, name: str) -> None:
        call(self.stub.SetPolicy, pb.SetPolicyRequest(policy=name), self.timeout, "set_policy")

    def release(self, gateway_id: str | None = None) -> None:
        # (on the wire "" is every gateway's: a proto3 string has no None)
        call(self.stub.Release, pb.ReleaseRequest(gateway_id=gateway_id or ""), self.timeout, "release")

    def close(self) -> None:
        self.channel.close()


class ComputeClient:
    """nanokv.service_api.ComputeAPI over gRPC."""

    def __init__(self, address: str, timeout_s: float):
        self.address = address
        self.timeout = timeout_s
        wait_serving(address, timeout_s)
        self.channel = intercept_channel(channel(address))  # the step span's traceparent goes along
        self.stub = pb_grpc.ComputeStub(self.channel)  # type: ignore[no-untyped-call]  # (generated, untyped)

    gateway_id = ""  # set by nanokv.gateway.recovery at attach
    epoch = 0

    def info(self) -> ModelInfo:
        return codec.info_from_pb(call(self.stub.Info, pb.Empty(), self.timeout, "info"))

    def tokenizer_files(self) -> dict[str, bytes]:
        # once, at start-up (the compute service writes the tokenizer's files): not held to a step's deadline
        reply = call(self.stub.GetTokenizer, pb.Empty(), max(self.timeout, STARTUP_TIMEOUT_S), "tokenizer")
        return {name: bytes(data) for name, data in reply.files.items()}

    def launch(self, request: StepRequest) -> PendingStep:
        request.epoch, request.gateway_id = self.epoch, self.gateway_id
        return StepFuture(self.stub.Step.future(codec.step_request_to_pb(request), timeout=self.timeout))

    def collect(self, launched: PendingStep) -> StepResult:
        return launched.wait()

    def step(self, request: StepRequest) -> StepResult:
        request.epoch, request.gateway_id = self.epoch, self.gateway_id
        return codec.step_result_from_pb(call(self.stub.Step, codec.step_request_to_pb(request), self.timeout,
                                              "step"))

    def stats(self) -> ComputeServiceStats:
        return codec.compute_stats_from_pb(call(self.stub.Stats, pb.Empty(), self.timeout, "stats"))

    def reset_stats(self) -> None:
        call(self.stub.ResetStats, pb.Empty(), self.timeout, "reset_stats")

    def reset(self) -> None:
        call(self.stub.Reset, pb.Empty(), self.timeout, "reset")

    def probe_errors(self) -> dict[int, dict[int, float]]:
        return codec.probe_errors_from_pb(call(self.stub.ProbeErrors, pb.Empty(), self.timeout, "probe_errors"))

    def repool(self, num_blocks: int | None = None, layer_bits: list[int] | None = None) -> ModelInfo:
        req = pb.RepoolRequest(num_blocks=num_blocks or 0, layer_bits=layer_bits or [])
        return codec.info_from_pb(call(self.stub.Repool, req, self.timeout, "repool"))

    def close(self) -> None:
        self.channel.close()
