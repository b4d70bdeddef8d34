"""The two seams the gateway talks through: the cache service's API and the compute service's.

Each has two implementations with the very same methods: the service object itself (the in-process
transport, LLM() by default: nanokv.cache_service.service.CacheService, nanokv.compute_service.service.
ComputeService) and its gRPC client (nanokv.gateway.clients: CacheClient, ComputeClient). The engine
holds one of each through these Protocols and never asks which it has; tests/protos/test_service_api.py
checks that both sides have exactly these methods, with the same signatures.

The services have a few methods more, which are not the gateway's: the compute service attaches its
pool to the cache service (CacheService.attach / detach / free_storage) and a server drops a dead
gateway's sequences (ComputeService.drop_sequences).

Common layer: only messages and the standard library (no torch, no grpc, no service).
"""

from __future__ import annotations

from typing import Protocol

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
from nanokv.service_config import CacheConfig


class PendingPlan(Protocol):
    """A plan sent, its reply read later (async scheduling plans the next step ahead)."""

    def wait(self) -> PlanReply: ...


class PendingStep(Protocol):
    """A launched step whose sampled tokens the gateway reads later (async scheduling)."""

    def wait(self) -> StepResult: ...


class CacheAPI(Protocol):
    """Blocks: one plan per step (nanokv.cache_service.planner), counters, the adaptive controller's
    policy rule (ghost evidence, a warm policy switch), and a gateway's release."""

    # plans sent ahead (plan_async): send to reply, summed. In process a plan is answered at once: 0.
    plan_rtt_s: float

    def info(self) -> tuple[CacheConfig, str]:
        """Its config (the gateway takes eviction and prefix-caching settings from it), and the model
        of the compute service attached ("": none)."""
        ...

    def plan(self, request: PlanRequest) -> PlanReply: ...

    def plan_async(self, request: PlanRequest) -> PendingPlan:
        """The plan sent now, its reply read with wait() (in process: planned at once)."""
        ...

    def stats(self) -> CacheServiceStats: ...

    def reset_prefix_cache(self, clear_stats: bool = False) -> None: ...

    def ghost_window(self) -> tuple[GhostScores, GhostScores] | None:
        """(this window's, the recent) ghost evidence, or None when nothing was looked up."""
        ...

    def restart_ghosts(self) -> None: ...

    def set_policy(self, name: str) -> None: ...

    def release(self, gateway_id: str | None = None) -> None:
        """Every sequence `gateway_id` holds ends and its blocks go back (None: every gateway's)."""
        ...

    def close(self) -> None: ...


class ComputeAPI(Protocol):
    """The model: its description, the tokenizer's files, one step per scheduled batch (whole, or
    launched and collected later), counters, and a pool change (repool)."""

    def info(self) -> ModelInfo: ...

    def tokenizer_files(self) -> dict[str, bytes]: ...

    def launch(self, request: StepRequest) -> PendingStep: ...

    def collect(self, launched: PendingStep) -> StepResult: ...

    def step(self, request: StepRequest) -> StepResult: ...

    def stats(self) -> ComputeServiceStats: ...

    def reset_stats(self) -> None: ...

    def reset(self) -> None:
        """A gateway starts over: no sequence, and steps count from 0 again."""
        ...

    def probe_errors(self) -> dict[int, dict[int, float]]: ...

    def repool(self, num_blocks: int | None = None, layer_bits: list[int] | None = None) -> ModelInfo: ...

    def close(self) -> None: ...
