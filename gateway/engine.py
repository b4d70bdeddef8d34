"""Engine: the step-level API (add_request / step / abort) that LLM and the servers drive.

It runs in the gateway: requests, tokenization, the scheduler, stop checks and detokenization.
Each step is one plan call to the cache service (which blocks) and one step call to the compute
service (which tokens), through a transport: the service objects themselves in this process
(LLM() by default), or gRPC clients of `nanokv cache` / `nanokv compute` processes
(EngineConfig.cache_address / compute_address). Both run the same service code. This module
imports no torch: the in-process services are imported only when they are built here.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nanokv.config import EngineConfig
from nanokv.errors import RequestError
from nanokv.gateway import engine_stats, traces
from nanokv.gateway.async_step import AsyncStepper
from nanokv.gateway.engine_stats import EngineCounters
from nanokv.gateway.outputs import RequestOutput  # callers import it from here too
from nanokv.gateway.outputs import on_token as token_output
from nanokv.gateway.prompts import chat_prompt, check_fits, load_gateway_tokenizer, tokenize
from nanokv.gateway.scheduler import Scheduler, SchedulerOutput
from nanokv.gateway.sequence import Sequence
from nanokv.gateway.step_request import build_step_request
from nanokv.gateway.warmup import warm_up
from nanokv.messages import COPY_LOAD, ModelInfo, StepRequest, StepResult
from nanokv.sampling import SamplingParams
from nanokv.service_api import CacheAPI, ComputeAPI

if TYPE_CHECKING:  # the in-process services' types: their modules import torch, which the gateway never does
    import torch

    from nanokv.cache_service.manager import KVCacheManager
    from nanokv.cache_service.service import CacheService
    from nanokv.cache_service.sparsity.decide import CacheSparsity
    from nanokv.compute_service.model.config import ModelConfig
    from nanokv.compute_service.service import ComputeService
    from nanokv.gateway.adaptive.controller import AdaptiveController
    from nanokv.gateway.recovery import Recovery

__all__ = ["Engine", "RequestOutput"]

log = logging.getLogger(__name__)


class Engine:
    _closers: list[Callable[[], None]] = []  # (shutdown: what to close; filled as the services come up)

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any):
        self.config = cfg = config if config is not None else EngineConfig.from_kwargs(**kwargs)
        self.local_cache: CacheService | None = None  # the in-process services (None when they run elsewhere)
        self.local_compute: ComputeService | None = None
        self.recovery: Recovery | None = None  # peers in other processes fail alone
        self._closers = []
        self.cache: CacheAPI
        self.compute: ComputeAPI
        if cfg.remote:
            from nanokv.gateway.clients import CacheClient, ComputeClient
            from nanokv.gateway.recovery import Recovery

            cache_client = CacheClient(cfg.cache_address or "", cfg.rpc_timeout_s)
            self.cache = cache_client
            self._closers.append(cache_client.close)
            compute_client = ComputeClient(cfg.compute_address or "", cfg.rpc_timeout_s)
            self.compute = compute_client
            self._closers.insert(0, compute_client.close)
            self.recovery = Recovery(self, cache_client, compute_client)
        else:
            from nanokv.cache_service.service import CacheService
            from nanokv.compute_service.service import ComputeService

            # an in-process cache service holds only memory; it goes with the engine (a later step then
            # fails on the compute service's own "shut down" error, not on a missing pool)
            local_cache = self.cache = self.local_cache = CacheService(cfg.cache)
            # the model whose KV the pool holds, as a compute service in another process tells at attach
            # (the disk tier's files carry it)
            local_cache.attached_model = cfg.compute.model or "SmolLM2-135M-Instruct"
            local_compute = ComputeService(cfg.compute, attach_pool=local_cache.attach,
                                           free_segment=local_cache.free_storage)
            self.compute = self.local_compute = local_compute
            self._closers.append(local_compute.close)
            self._closers.append(local_cache.close_disk)  # its directory lock: another engine may open it
        info = self.model_info = self.compute.info()
        self.model_name = info.name
        self.max_model_len = info.max_position_embeddings
        self.num_blocks = info.num_blocks
        self.device_type = info.device
        # the model's own config in-process (tools and tests read it); its essentials otherwise
        self.model_config: ModelConfig | ModelInfo = (self.local_compute.model_config
                                                      if self.local_compute is not None else info)
        # a transformers tokenizer (None for random-weight models): typed by no stub the gateway can read
        self.tokenizer: Any
        self.tokenizer, self._tokenizer_dir = load_gateway_tokenizer(cfg, self.compute)
        self.scheduler = self._new_scheduler()
        if self.recovery is not None:
            self.recovery.attach()  # a new gateway takes over: what any earlier one held is released
        eos = set(info.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = eos
        self._seqs: dict[str, Sequence] = {}
        self._finished_ids: list[int] = []  # ended sequences the compute service has yet to forget
        self._copy_seqs: dict[int, int] = {}  # step id -> the last plan whose tier copies it runs
        self._onloads: dict[int, float] = {}  # step id -> when its loads from lower tiers were sent
        self.stashed: list[RequestOutput] = []  # a step a repool landed mid-step: the next step returns them
        self._ids = itertools.count()
        self._step_ids = itertools.count()
        self.counters = EngineCounters()  # tokens and batch sizes (nanokv.gateway.engine_stats)
        # gateway time per step: in the plan call, blocked in the step call, building the step request,
        # reading the sampled tokens (the last two: async scheduling only)
        self.rpc: dict[str, float] = {"steps": 0, "plan_calls": 0, "step_calls": 0, "plan_s": 0.0, "step_s": 0.0,
                                      "build_s": 0.0, "tokens_s": 0.0}
        self._async: AsyncStepper | None = None
        tp = cfg.tensor_parallel_size
        if cfg.async_scheduling or (cfg.async_scheduling is None and self.device_type == "cuda" and tp == 1):
            self._async = AsyncStepper(self)
        self.controller: AdaptiveController | None = None  # self-tuning, off unless asked
        warm_up(self)  # CUDA: compile what a chunked prompt needs now, not mid-request (nanokv.gateway.warmup)
        cfg = self.config  # (with remote services: the cache service's settings, taken at attach)
        if cfg.adaptive or cfg.eviction_policy == "adaptive":
            from nanokv.gateway.adaptive.engine_glue import build_controller
            self.controller = build_controller(self)

    # ---- the in-process services' internals (tools, tests, sparsity, the adaptive controller) ------
    @property
    def runner(self) -> Any:  # ModelRunner, or TPModelRunner (a drop-in that forwards to rank 0's runner)
        if self.local_compute is None:
            raise AttributeError("runner: the compute service runs in another process")
        return self.local_compute.runner

    @property
    def cache_manager(self) -> KVCacheManager:
        if self.local_cache is None:
            raise AttributeError("cache_manager: the cache service runs in another process")
        if self.local_cache.manager is None:
            raise AttributeError("cache_manager: no pool is attached")
        return self.local_cache.manager

    @property
    def sparsity(self) -> CacheSparsity | None:
        """Block sparsity's decisions and counters in the in-process cache service (None when off)."""
        if self.local_cache is None:
            raise AttributeError("sparsity: the cache service runs in another process (its stats count it)")
        return self.local_cache.planner.sparsity if self.local_cache.planner is not None else None

    @property
    def model(self) -> torch.nn.Module:
        if self.local_compute is None:
            raise AttributeError("model: the compute service runs in another process")
        return self.local_compute.model

    @property
    def dtype(self) -> torch.dtype:
        if self.local_compute is None:
            raise AttributeError("dtype: the compute service runs in another process")
        return self.local_compute.dtype

    @property
    def device(self) -> torch.device | _Device:
        if self.local_compute is not None:
            return self.local_compute.device
        return _Device(self.device_type)

    def _new_scheduler(self) -> Scheduler:
        cfg = self.config
        return Scheduler(self.cache, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                         enable_chunked_prefill=cfg.enable_chunked_prefill)

    # ---- requests -----------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        return chat_prompt(self.tokenizer, messages)

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize(self.tokenizer, prompt, self.model_config.vocab_size)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        params = params if params is not None else SamplingParams()
        if request_id in self._seqs:
            raise RequestError("request_id", f"{request_id!r} is already in use")
        ids = self._tokenize(prompt)
        n = len(ids)
        max_tokens = check_fits(n, params.max_tokens, self.max_model_len, self.model_info.block_size,
                                self.num_kv_blocks)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestError("cache_salt", "must be a string")
        seq = Sequence(next(self._ids), request_id, ids, params, max_tokens, cache_salt=cache_salt)
        if arrival_time is not None:
            seq.metrics.arrival_time = arrival_time
        traces.start_request(seq, self.model_name)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        self.counters.tokens["prompt_tokens"] += n

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is None or seq.is_finished:
            return
        seq.finish_reason = "abort"
        self.retire(seq)
        self.flush()  # its blocks go back now (one plan call), not with the next step

    def retire(self, seq: Sequence) -> None:
        """`seq` ended (finished or aborted; finish_reason set): its blocks go back to the cache with the
        next plan, the compute service forgets it with the next step, its span ends."""
        self.scheduler.finish(seq)
        self._finished_ids.append(seq.seq_id)
        self._seqs.pop(seq.request_id, None)
        traces.end_request(seq)

    def drop_all_requests(self) -> list[str]:
        """A peer failed (nanokv.gateway.recovery): every request ends here without a word to the
        services, which start over at the next attach; a fresh scheduler. Returns the requests' ids."""
        ended = list(self._seqs)
        self._seqs.clear()
        self._finished_ids = []
        if self._async is not None:
            self._async.pending = None
        self.scheduler = self._new_scheduler()
        return ended

    def attached(self, info: ModelInfo) -> None:
        """(Re)attached to the compute service's pool `info` (recovery): steps count from 0 again."""
        self.model_info = info
        self._step_ids = itertools.count()

    def pool_changed(self, info: ModelInfo) -> None:
        """The compute service runs on a new pool (nanokv.gateway.repool): it forgot every sequence."""
        self._finished_ids = []
        self.num_blocks = info.num_blocks
        self.model_info = info

    def land(self) -> list[RequestOutput]:
        """Async scheduling: finish the step in flight now (its outputs are returned) and wait for the plan
        sent ahead, before anything changes the KV tensors or the pool (AsyncStepper.land)."""
        return self._async.land() if self._async is not None else []

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the pool (in-process the adaptive pool rule may resize it)."""
        cm = self.local_cache.manager if self.local_cache is not None else None
        return int(cm.num_blocks) if cm is not None else self.num_blocks

    @property
    def ready(self) -> bool:
        """Attached to live services (always, in process); false during a peer's outage."""
        return self.recovery is None or self.recovery.ready

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or (self._async is not None and self._async.pending is not None)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- one step -----------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one scheduler step. Returns an output per sampled token, or with `finished_only`
        (batch use: LLM.generate) only those of requests that finished, skipping the per-token
        output objects (about 4 us each, a millisecond a step at batch 256)."""
        with traces.step_span(self):  # its own trace, linked to the requests it serves
            # a repool outside a step lands the step in flight (its tokens come before this step's); one
            # the controller makes at this step's end lands the step just launched (they come after)
            before, self.stashed = self.stashed, []
            if self._async is not None:
                outputs = self._async.step(finished_only)
            else:
                outputs = self._sync_step(finished_only)
            if before or self.stashed:
                after, self.stashed = self.stashed, []
                outputs = [o for o in (*before, *outputs, *after) if o.finished or not finished_only]
            if not self.has_unfinished_requests():
                self.flush()  # idle: ended sequences' blocks go back now, not with the next request
        return outputs

    def _sync_step(self, finished_only: bool) -> list[RequestOutput]:
        out = self.schedule()
        if out.is_empty:
            return []
        sched = out.scheduled
        req = self.step_request(out)
        res = self.run_step(req)
        self.scheduler.update(out)
        # block sparsity: the cache service drops / demotes with the next plan, after these commits
        # publish what this step computed, ranking by these scores (nanokv.cache_service.sparsity.decide)
        self.scheduler.note_scores(res.block_scores)
        self.counters.count_step(out)
        outputs: list[RequestOutput] = []
        lps = res.logprobs or [None] * len(res.token_ids)
        for r, tok, lp in zip(req.sample_rows, res.token_ids, lps):
            o = self.on_token(sched[r].seq, tok, lp, finished_only)
            if o is not None:
                outputs.append(o)
        if self.controller is not None:
            self.controller.on_step(out)
        return outputs

    def schedule(self) -> SchedulerOutput:
        """The scheduler's step: one plan call to the cache service (or the reply of the one sent
        ahead), timed: plan_s is the gateway's time in plan calls, not what the pipeline hid."""
        t0 = time.perf_counter()
        calls = self.scheduler.plan_calls
        out = self.scheduler.schedule()
        if self.scheduler.plan_calls != calls:
            self.rpc["plan_calls"] += 1
        self.rpc["plan_s"] += time.perf_counter() - t0
        return out

    def plan_ahead(self, pending: dict[int, int]) -> None:
        """Async scheduling: the next step's plan goes out now (Scheduler.plan_ahead); its reply is
        read by the next schedule(), so over gRPC the round trip overlaps the step in flight."""
        t0 = time.perf_counter()
        calls = self.scheduler.plan_calls
        self.scheduler.plan_ahead(pending)
        if self.scheduler.plan_calls != calls:
            self.rpc["plan_calls"] += 1
            self.rpc["plan_s"] += time.perf_counter() - t0

    def run_step(self, req: StepRequest) -> StepResult:
        t0 = time.perf_counter()
        res = self.compute.step(req)
        self.stepped(res.step_id)
        self.rpc["steps"] += 1
        self.rpc["step_calls"] += 1
        self.rpc["step_s"] += time.perf_counter() - t0
        return res

    def stepped(self, step_id: int) -> None:
        """A step's result is in: the tier copies it ran are done (the next plan tells the cache)."""
        seq = self._copy_seqs.pop(step_id, 0)
        if seq:
            self.scheduler.copies_ran(seq)
        t0 = self._onloads.pop(step_id, None)
        if t0 is not None:  # the loads this step ran have landed (and its forward pass has read them)
            self.counters.onload_s.append(time.perf_counter() - t0)

    def step_request(self, out: SchedulerOutput) -> StepRequest:
        """The compute service's view of a scheduled step (nanokv.gateway.step_request); the ended
        sequences it carries are then off the engine's list."""
        req = build_step_request(out, next(self._step_ids), self._finished_ids)
        req.copies, seq = self.scheduler.take_copies()
        if seq:
            self._copy_seqs[req.step_id] = seq
        if any(kind == COPY_LOAD for kind, _, _ in req.copies):
            self._onloads[req.step_id] = time.perf_counter()
        req.demotions = self.scheduler.take_demotions()  # hybrid sparsity's copies, before this step writes
        self._finished_ids = []
        return req

    def repool(self, num_blocks: int | None = None, layer_bits: list[int] | None = None) -> list[RequestOutput]:
        """Change the KV pool's block count or per-layer widths while serving (nanokv.gateway.repool):
        live requests are recomputed on the new pool. Returns the outputs of the step in flight."""
        from nanokv.gateway.repool import repool

        return repool(self, num_blocks, layer_bits)

    def flush(self) -> None:
        """Tell the services now what they would otherwise learn with the next step: the blocks of
        ended sequences go back to the cache, their state leaves the compute service."""
        if self.scheduler.has_news():
            t0 = time.perf_counter()
            self.scheduler.flush()
            self.rpc["plan_calls"] += 1
            self.rpc["plan_s"] += time.perf_counter() - t0
        if self._finished_ids and (self._async is None or self._async.pending is None):
            self.run_step(StepRequest(next(self._step_ids), finished=self._finished_ids,
                                      demotions=self.scheduler.take_demotions()))
            self.rpc["steps"] -= 1  # not a scheduling step
            self._finished_ids = []

    def tick_idle(self) -> None:
        """Nothing to run: the controller still counts a step, so its windows keep closing while the
        engine is idle (the pool rule shrinks a grown KV pool back after idle windows). The server's
        engine thread calls this each time it wakes without work (every stats interval)."""
        if not self.scheduler.has_unfinished():
            self.flush()
        if self.controller is not None and not self.scheduler.has_unfinished():
            self.controller.on_step(None)

    def on_token(self, seq: Sequence, tok: int, lp: tuple[float, dict[int, float]] | None,
                 finished_only: bool = False, replace: bool = False) -> RequestOutput | None:
        """The sampled token `tok` joins `seq`: stop checks and its output (nanokv.gateway.outputs)."""
        return token_output(self, seq, tok, lp, finished_only, replace)

    # ---- lifecycle ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release what outlives a step: in-process services (tensor-parallel workers, the KV
        segment) or the gRPC channels. Idempotent; safe on an engine whose start-up failed halfway."""
        closers, self._closers = self._closers, []
        for close in closers:
            close()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - never raise from a finaliser (e.g. at interpreter exit)
            pass

    # ---- observability ------------------------------------------------------------------------
    def reset_counters(self) -> None:
        """Every counter stats() reports back to zero (nanokv.gateway.engine_stats)."""
        engine_stats.reset_counters(self)

    def stats(self) -> engine_stats.EngineStats:
        """One snapshot of the engine and its services (nanokv.gateway.engine_stats)."""
        return engine_stats.stats(self)


class _Device:
    """torch.device's `type` for code that asks the engine where it runs (no torch in the gateway)."""

    def __init__(self, type_: str):
        self.type = type_
