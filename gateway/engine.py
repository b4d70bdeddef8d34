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
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from nanokv.config import EngineConfig
from nanokv.errors import RequestError
from nanokv.gateway import traces
from nanokv.gateway.async_step import AsyncStepper
from nanokv.gateway.detokenizer import check_stop_strings, detokenize_step
from nanokv.gateway.scheduler import Scheduler, SchedulerOutput
from nanokv.gateway.sequence import RequestMetrics, Sequence
from nanokv.gateway.warmup import warm_up
from nanokv.messages import StepRequest
from nanokv.model_files import load_tokenizer
from nanokv.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far; while unfinished a live view (copy to keep)
    new_token_ids: list[int]
    text: str
    delta_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[dict[str, Any]] | None
    metrics: RequestMetrics
    error: str | None = None
    stop_reason: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


class Engine:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any):
        self.config = cfg = config if config is not None else EngineConfig.from_kwargs(**kwargs)
        self.local_cache: Any = None  # the in-process services (None when they run elsewhere)
        self.local_compute: Any = None
        self.recovery: Any = None  # nanokv.gateway.recovery.Recovery: peers in other processes fail alone
        if cfg.remote:
            from nanokv.gateway.clients import CacheClient, ComputeClient
            from nanokv.gateway.recovery import Recovery

            self.cache: Any = CacheClient(cfg.cache_address or "", cfg.rpc_timeout_s)
            self.compute: Any = ComputeClient(cfg.compute_address or "", cfg.rpc_timeout_s)
            self.recovery = Recovery(self)
        else:
            from nanokv.cache_service.service import CacheService
            from nanokv.compute_service.service import ComputeService

            self.cache = self.local_cache = CacheService(cfg)
            self.compute = self.local_compute = ComputeService(cfg, attach_pool=self.local_cache.attach)
        info = self.model_info = self.compute.info()
        self.model_name = info.name
        self.max_model_len = info.max_position_embeddings
        self.num_blocks = info.num_blocks
        self.device_type = info.device
        # the model's own config in-process (tools and tests read it); its essentials otherwise
        self.model_config: Any = self.local_compute.model_config if self.local_compute is not None else info
        self.tokenizer = self._load_tokenizer()
        self.scheduler = Scheduler(self.cache, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   enable_chunked_prefill=cfg.enable_chunked_prefill)
        if self.recovery is not None:
            self.recovery.attach()  # a new gateway takes over: what any earlier one held is released
        self.sparsity: Any = None
        if self.local_compute is not None:
            from nanokv.compute_service.sparsity.engine_hook import attach as attach_sparsity

            self.sparsity = attach_sparsity(cfg, self.cache_manager, self.runner)  # None unless sparsity > 0
        eos = set(info.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = eos
        self._seqs: dict[str, Sequence] = {}
        self._finished_ids: list[int] = []  # ended sequences the compute service has yet to forget
        self.stashed: list[RequestOutput] = []  # a step a repool landed mid-step: the next step returns them
        self._ids = itertools.count()
        self._step_ids = itertools.count()
        self._counters = {"prompt_tokens": 0, "generation_tokens": 0, "computed_tokens": 0}
        self._batch_sizes: list[int] = []
        self._last_batch_size = 0
        # gateway time per step: in the plan call, blocked in the step call, building the step request,
        # reading the sampled tokens (the last two: async scheduling only)
        self.rpc = {"steps": 0, "plan_calls": 0, "step_calls": 0, "plan_s": 0.0, "step_s": 0.0, "build_s": 0.0,
                    "tokens_s": 0.0}
        self._async: AsyncStepper | None = None
        tp = cfg.tensor_parallel_size
        adaptive_here = (cfg.adaptive or cfg.eviction_policy == "adaptive") and not cfg.remote
        if cfg.async_scheduling or (cfg.async_scheduling is None and self.device_type == "cuda" and tp == 1
                                    and self.sparsity is None and not adaptive_here):
            self._async = AsyncStepper(self)
        self.controller: Any = None  # nanokv.gateway.adaptive.AdaptiveController: self-tuning, off unless asked
        warm_up(self)  # CUDA: compile what a chunked prompt needs now, not mid-request (nanokv.gateway.warmup)
        if cfg.adaptive or cfg.eviction_policy == "adaptive":
            from nanokv.gateway.adaptive.engine_glue import build_controller
            self.controller = build_controller(self)

    def _load_tokenizer(self) -> Any:
        """The model's tokenizer: from its files in process; from the compute service otherwise (the
        gateway needs no model files), loaded without torch."""
        model = self.config.model
        if model is not None and model.startswith("random:"):
            return None
        if not self.config.remote:
            return load_tokenizer(model)
        files = self.compute.tokenizer_files()
        self._tokenizer_dir = tempfile.TemporaryDirectory(prefix="nanokv-tokenizer-")
        for name, data in files.items():
            if os.path.basename(name) != name:
                raise ValueError(f"tokenizer file name {name!r}")
            with open(os.path.join(self._tokenizer_dir.name, name), "wb") as f:
                f.write(data)
        return load_tokenizer(self._tokenizer_dir.name, without_torch=True, kind="hf_tokenizer")

    # ---- the in-process services' internals (tools, tests, sparsity, the adaptive controller) ------
    @property
    def runner(self) -> Any:
        if self.local_compute is None:
            raise AttributeError("runner: the compute service runs in another process")
        return self.local_compute.runner

    @property
    def cache_manager(self) -> Any:
        if self.local_cache is None:
            raise AttributeError("cache_manager: the cache service runs in another process")
        return self.local_cache.manager

    @property
    def model(self) -> Any:
        return self.runner.model

    @property
    def dtype(self) -> Any:
        return self.runner.dtype

    @property
    def device(self) -> Any:
        if self.local_compute is not None:
            return self.local_compute.device
        return _Device(self.device_type)

    # ---- requests -----------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("messages", "this model has no tokenizer; send token ids")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages", "must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise RequestError(f"messages[{i}].content", "must be a string")
            if m.get("role") not in ("system", "user", "assistant"):
                raise RequestError(f"messages[{i}].role", "allowed roles: system, user, assistant")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt", "this model has no tokenizer; send token ids")
            if not prompt:
                raise RequestError("prompt", "must not be empty")
            return list(self.tokenizer(prompt)["input_ids"])
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("prompt", "must be a non-empty string or a non-empty list of token ids")
        V = self.model_config.vocab_size
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V:
                raise RequestError("prompt", f"token id {t!r} out of range; allowed: integers in [0, {V})")
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        params = params if params is not None else SamplingParams()
        if request_id in self._seqs:
            raise RequestError("request_id", f"{request_id!r} is already in use")
        ids = self._tokenize(prompt)
        n, L = len(ids), self.max_model_len
        if n >= L:
            raise RequestError("prompt", f"prompt has {n} tokens; the context is {L} tokens "
                                         f"(max_model_len), so at most {L - 1} are allowed")
        max_tokens = params.max_tokens if params.max_tokens is not None else L - n
        if n + max_tokens > L:
            raise RequestError("max_tokens", f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the "
                                             f"context of {L} tokens; allowed: at most {L - n}")
        bs = self.model_info.block_size
        need = (n + max_tokens + bs - 1) // bs
        if need > self.num_kv_blocks:
            cap = self.num_kv_blocks * bs  # tokens the whole cache holds
            if n >= cap:
                raise RequestError("prompt", f"prompt has {n} tokens; the whole KV cache holds {cap}, so at most "
                                             f"{cap - 1} are allowed")
            raise RequestError("max_tokens", f"prompt + max_tokens needs {need} KV blocks but the whole cache "
                                             f"has {self.num_kv_blocks}; allowed: at most {cap - n}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestError("cache_salt", "must be a string")
        seq = Sequence(next(self._ids), request_id, ids, params, max_tokens, cache_salt=cache_salt)
        if arrival_time is not None:
            seq.metrics.arrival_time = arrival_time
        traces.start_request(seq, self.model_name)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        self._counters["prompt_tokens"] += n

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is None or seq.is_finished:
            return
        self.scheduler.abort(seq)
        self._finished_ids.append(seq.seq_id)
        seq.finish_reason = "abort"
        traces.end_request(seq)
        self.flush()  # its blocks go back now (one plan call), not with the next step

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the pool (in-process the adaptive pool rule may resize it)."""
        cm = self.local_cache.manager if self.local_cache is not None else None
        return cm.num_blocks if cm is not None else self.num_blocks

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
        if self.sparsity is not None:  # block sparsity: drop / demote per policy (nanokv.compute_service.sparsity)
            # publish this step's blocks before any of them is dropped (a dropped block stays cached)
            self.scheduler.flush()
            self.sparsity.after_step(sched)
        self._count_step(out)
        outputs: list[RequestOutput] = []
        lps = res.logprobs or [None] * len(res.token_ids)
        for r, tok, lp in zip(req.sample_rows, res.token_ids, lps):
            o = self._on_token(sched[r].seq, tok, lp, finished_only)
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

    def run_step(self, req: StepRequest) -> Any:
        t0 = time.perf_counter()
        res = self.compute.step(req)
        self.rpc["steps"] += 1
        self.rpc["step_calls"] += 1
        self.rpc["step_s"] += time.perf_counter() - t0
        return res

    def step_request(self, out: SchedulerOutput) -> StepRequest:
        """The compute service's view of a scheduled step: rows prefills first, each row's input
        tokens, the rows that sample, and what changed since the last step."""
        sched = out.scheduled
        traces.link_step(out)
        req = StepRequest(next(self._step_ids), num_prefills=len(out.prefills), tables=out.tables,
                          preempted=[s.seq_id for s in out.preempted])
        now = time.monotonic()
        tokens = req.tokens
        for r, s in enumerate(sched):
            seq = s.seq
            start, n = seq.num_computed_tokens, s.num_new_tokens
            req.seq_ids.append(seq.seq_id)
            req.num_computed.append(start)
            req.num_new.append(n)
            if n == 1:
                tokens.append(seq.token_ids[start])
            else:
                tokens.extend(seq.token_ids[start:start + n])
            if start + n == seq.num_tokens:
                req.sample_rows.append(r)
            if not seq.params_sent:
                req.new_seqs.append((seq.seq_id, seq.params))
                seq.params_sent = True
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        req.finished, self._finished_ids = self._finished_ids, []
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
            self.run_step(StepRequest(next(self._step_ids), finished=self._finished_ids))
            self.rpc["steps"] -= 1  # not a scheduling step
            self._finished_ids = []

    def _count_step(self, out: Any) -> None:
        self._counters["computed_tokens"] += out.num_tokens
        self._last_batch_size = len(out.scheduled)
        self._batch_sizes.append(len(out.scheduled))
        if len(self._batch_sizes) > 10000:
            del self._batch_sizes[:5000]

    def tick_idle(self) -> None:
        """Nothing to run: the controller still counts a step, so its windows keep closing while the
        engine is idle (the pool rule shrinks a grown KV pool back after idle windows). The server's
        engine thread calls this each time it wakes without work (every stats interval)."""
        if not self.scheduler.has_unfinished():
            self.flush()
        if self.controller is not None and not self.scheduler.has_unfinished():
            self.controller.on_step(None)

    def _on_token(self, seq: Sequence, tok: int, lp: tuple[float, dict[int, float]] | None,
                  finished_only: bool = False, replace: bool = False) -> RequestOutput | None:
        """The sampled token `tok` joins `seq` (replace: it takes the async placeholder's place);
        stop checks; the request's output unless `finished_only` and it goes on."""
        now = time.monotonic()
        if replace:
            seq.set_last_token(tok)
        else:
            seq.append_token(tok)
        self.scheduler.note_token(seq, tok)
        self._counters["generation_tokens"] += 1
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        if lp is not None:
            seq.logprobs.append({"token_id": tok, "logprob": lp[0], "top": lp[1]})
        p = seq.params
        reason = None
        before = len(seq.text)
        delta_len = 0
        if self.tokenizer is not None:
            delta_len = len(detokenize_step(self.tokenizer, seq))
        if not p.ignore_eos and tok in self.eos_token_ids:
            reason = "stop"
        elif tok in p.stop_token_ids:
            reason, seq.stop_reason = "stop", tok
        elif check_stop_strings(seq, delta_len):
            reason = "stop"
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            seq.metrics.finish_time = now
            self.scheduler.finish(seq)
            self._finished_ids.append(seq.seq_id)
            self._seqs.pop(seq.request_id, None)
            traces.end_request(seq)
        elif finished_only:
            return None
        new_tokens = seq.output_token_ids[seq.sent_tokens:]
        seq.sent_tokens = seq.num_output_tokens
        delta_text = seq.text[min(before, len(seq.text)):] if reason is None else seq.text[seq.sent_text_len:]
        seq.sent_text_len = len(seq.text)
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            # copying the whole output on every token is O(n^2) per request: only the final one is a copy
            token_ids=list(seq.output_token_ids) if reason is not None else seq.output_token_ids,
            new_token_ids=new_tokens, text=seq.text,
            delta_text=delta_text, finished=reason is not None, finish_reason=reason,
            num_cached_tokens=seq.num_cached_tokens, logprobs=list(seq.logprobs) if p.logprobs is not None else None,
            metrics=seq.metrics, stop_reason=seq.stop_reason,
        )

    # ---- lifecycle ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release what outlives a step: in-process services (tensor-parallel workers, the KV
        segment) or the gRPC channels. Idempotent."""
        # an in-process cache service holds only memory; it goes with the engine (a later step then
        # fails on the compute service's own "shut down" error, not on a missing pool)
        cache = None if getattr(self, "local_cache", None) is not None else getattr(self, "cache", None)
        for svc in (getattr(self, "compute", None), cache):
            stop = getattr(svc, "shutdown", None) or getattr(svc, "close", None)
            if stop is not None:
                stop()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - never raise from a finaliser (e.g. at interpreter exit)
            pass

    # ---- observability ------------------------------------------------------------------------
    def reset_counters(self) -> None:
        """Every counter stats() reports back to zero (start-up only: nanokv.gateway.warmup)."""
        self.flush()
        self.cache.reset_prefix_cache(clear_stats=True)
        self.compute.reset_stats()
        self.scheduler.num_preemptions = 0
        self._counters = dict.fromkeys(self._counters, 0)
        self._batch_sizes.clear()
        self._last_batch_size = 0
        self.rpc = dict.fromkeys(self.rpc, 0) | {k: 0.0 for k in self.rpc if k.endswith("_s")}
        if hasattr(self.cache, "plan_rtt_s"):
            self.cache.plan_rtt_s = 0.0

    def stats(self) -> dict[str, Any]:
        cs = self.cache.stats()
        comp = self.compute.stats()
        batch_sizes, self._batch_sizes = self._batch_sizes, []
        return {
            "kv_cache_usage": cs["kv_cache_usage"],
            "kv_blocks_total": cs["kv_blocks_total"],  # changes when the adaptive pool rule resizes
            "num_running": self.num_running(),
            "num_waiting": self.num_waiting(),
            "prefix_queries_tokens": cs["prefix_queries_tokens"],
            "prefix_hits_tokens": cs["prefix_hits_tokens"],
            "evictions_by_policy": cs["evictions_by_policy"],
            "eviction_policy": cs["eviction_policy"],  # the live one (the controller may switch)
            "recomputed_tokens": cs["recomputed_tokens"],
            "preemptions": self.scheduler.num_preemptions,
            "last_batch_size": self._last_batch_size,
            "batch_sizes": batch_sizes,
            "compression_error": comp["compression_error"],
            "adaptations": dict(self.controller.counts) if self.controller is not None else {},
            "rpc": dict(self.rpc, plan_rtt_s=getattr(self.cache, "plan_rtt_s", 0.0)),
            **self._counters,
        }


class _Device:
    """torch.device's `type` for code that asks the engine where it runs (no torch in the gateway)."""

    def __init__(self, type_: str):
        self.type = type_
