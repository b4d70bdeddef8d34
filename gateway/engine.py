"""Engine: the step-level API (add_request / step / abort) that LLM and the server drive."""

from __future__ import annotations

import gc
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nanokv.cache_service.kv.monitor import CompressionMonitor
from nanokv.cache_service.manager import KVCacheManager
from nanokv.compute_service.runner.model_runner import ModelRunner, resolve_device, resolve_dtype
from nanokv.compute_service.runner.sampler import Sampler
from nanokv.config import EngineConfig
from nanokv.errors import RequestError
from nanokv.gateway.async_step import AsyncStepper
from nanokv.gateway.detokenizer import check_stop_strings, detokenize_step
from nanokv.gateway.scheduler import Scheduler
from nanokv.gateway.sequence import RequestMetrics, Sequence
from nanokv.gateway.warmup import warm_logits, warm_up
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
        from nanokv.compute_service.model.loader import load_model, load_tokenizer, random_model

        self.config = cfg = config if config is not None else EngineConfig.from_kwargs(**kwargs)
        torch.manual_seed(cfg.seed)
        self.device = resolve_device(cfg)
        self.dtype = resolve_dtype(cfg, self.device)
        tp = cfg.tensor_parallel_size  # this process is TP rank 0: it loads rank 0's shard
        if cfg.model is not None and cfg.model.startswith("random:"):
            self.model, self.model_config = random_model(cfg.model[len("random:"):], self.dtype, self.device,
                                                         seed=cfg.seed, tp_size=tp)
            self.tokenizer = None
        else:
            self.model, self.model_config = load_model(cfg.model, self.dtype, self.device, tp_size=tp)
            self.tokenizer = load_tokenizer(cfg.model)
        self.model_name = cfg.model or "SmolLM2-135M-Instruct"
        mc = self.model_config
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.runner: Any  # ModelRunner, or TPModelRunner (a drop-in that forwards to rank 0's runner)
        if tp > 1:
            from nanokv.compute_service.runner.tp_runner import TPModelRunner  # starts the workers (ranks 1..tp-1)

            self.runner = TPModelRunner(cfg, self.model, mc, self.device, self.dtype)
        else:
            self.runner = ModelRunner(cfg, self.model, mc, self.device, self.dtype)
            self.runner.fold_value_rotations()  # (this engine owns the model; tensor parallel keeps the GEMMs)
        self.runner.capture_cudagraphs(self.max_model_len)
        # running K/V quantization error per layer (sampled on eager steps), read by stats()
        self.compression_monitor = CompressionMonitor().attach(self.runner.kv_caches)
        self.cache_manager = KVCacheManager(
            self.runner.num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching,
            # "adaptive": start from the default policy; the controller switches when it pays
            eviction_policy="clock" if cfg.eviction_policy == "adaptive" else cfg.eviction_policy,
            lru_k=cfg.lru_k, hash_algo=cfg.prefix_caching_hash_algo,
        )
        stage = getattr(self.runner, "stage", None)
        if stage is not None:  # int4 staging may reclaim slots of open blocks whose sequence ended
            pool = self.cache_manager.pool
            stage.block_free = lambda b: pool.ref[b] == 0
        self.scheduler = Scheduler(self.cache_manager, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   enable_chunked_prefill=cfg.enable_chunked_prefill)
        from nanokv.compute_service.sparsity.engine_hook import (
            attach as attach_sparsity,  # None unless compression_sparsity > 0
        )
        self.sparsity = attach_sparsity(cfg, self.cache_manager, self.runner)
        self.sampler = Sampler(self.device)
        eos = set(mc.eos_token_ids or [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = eos
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._counters = {"prompt_tokens": 0, "generation_tokens": 0, "computed_tokens": 0}
        self._batch_sizes: list[int] = []
        # NANOKV_STEP_TIMING=1: per-phase wall time of each step (syncs the GPU; for profiling only)
        self._timing: dict[str, float] | None = (
            dict.fromkeys(("steps", "schedule_s", "forward_s", "sample_postprocess_s"), 0.0)
            if os.environ.get("NANOKV_STEP_TIMING") else None)
        self._last_batch_size = 0
        # see _freeze_gc; CUDA only: frozen objects are never collected, so a process that builds
        # and drops many engines (the CPU test suite) would keep every dropped one's cycles alive
        self._gc_freezes = 2 if self.device.type == "cuda" and not os.environ.get("NANOKV_NO_GC_FREEZE") else 0
        self._async: AsyncStepper | None = None
        if cfg.async_scheduling or (cfg.async_scheduling is None and self.device.type == "cuda" and tp == 1
                                    and self.sparsity is None and not cfg.adaptive
                                    and cfg.eviction_policy != "adaptive"):
            self._async = AsyncStepper(self)
        warm_up(self)  # CUDA: compile what a chunked prompt needs now, not mid-request (nanokv.gateway.warmup)
        warm_logits(self)  # CUDA: load the LM head's GEMM kernels for every sampling row count
        self.controller: Any = None  # nanokv.gateway.adaptive.AdaptiveController: self-tuning, off unless asked for
        if cfg.adaptive or cfg.eviction_policy == "adaptive":
            from nanokv.gateway.adaptive.engine_glue import build_controller
            self.controller = build_controller(self)

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
        bs = self.config.block_size
        need = (n + max_tokens + bs - 1) // bs
        if need > self.cache_manager.num_blocks:
            raise RequestError("max_tokens", f"prompt + max_tokens needs {need} KV blocks but the whole cache "
                                             f"has {self.cache_manager.num_blocks}; lower max_tokens")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestError("cache_salt", "must be a string")
        seq = Sequence(next(self._ids), request_id, ids, params, max_tokens, cache_salt=cache_salt)
        if arrival_time is not None:
            seq.metrics.arrival_time = arrival_time
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        self._counters["prompt_tokens"] += n

    def abort(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is None or seq.is_finished:
            return
        self.scheduler.abort(seq)
        self.sampler.forget(seq.seq_id)
        seq.finish_reason = "abort"

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
        if self._gc_freezes:
            self._freeze_gc()
        if self._async is not None:
            return self._async.step(finished_only)
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        sched = out.scheduled
        items, rows = self._step_items(out)
        t1 = time.perf_counter()
        logits = self.runner.execute(items, rows)
        if self._timing is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # only when timing: attribute device time to the forward
        t2 = time.perf_counter()
        self.scheduler.update(out)
        if self.sparsity is not None:  # block sparsity: drop / demote per policy (nanokv.compute_service.sparsity)
            self.sparsity.after_step(sched)
        self._count_step(out)
        outputs: list[RequestOutput] = []
        if rows:
            seqs = [sched[r].seq for r in rows]
            assert logits is not None  # rows to sample always get logits
            res = self.sampler(logits, [s.params for s in seqs], [s.seq_id for s in seqs])
            for seq, tok, lp in zip(seqs, res.token_ids, res.logprobs):
                o = self._on_token(seq, tok, lp, finished_only)
                if o is not None:
                    outputs.append(o)
        if self.controller is not None:
            self.controller.on_step(out)
        if self._timing is not None:
            t3 = time.perf_counter()
            tm = self._timing
            tm["steps"] += 1
            tm["schedule_s"] += t1 - t0
            tm["forward_s"] += t2 - t1
            tm["sample_postprocess_s"] += t3 - t2
        return outputs

    def _freeze_gc(self) -> None:
        """At the first two steps (the second one catches what the first step's torch.compile made):
        move every object alive now (model, compiled graphs, tokenizer: millions after torch.compile)
        out of the cyclic GC's reach, as vLLM does after start-up. A full collection would otherwise
        walk them all again, stalling the host at random steps; they live as long as the engine."""
        self._gc_freezes -= 1
        gc.collect()
        gc.freeze()

    def _step_items(self, out: Any) -> tuple[list[tuple], list[int]]:
        """The runner's per-sequence items (token ids, computed, new, block table, is prefill),
        prefills first, and the rows that sample."""
        sched = out.scheduled
        n_pre = len(out.prefills)
        items = [(s.seq.token_ids, s.seq.num_computed_tokens, s.num_new_tokens, s.block_table, i < n_pre)
                 for i, s in enumerate(sched)]
        rows = [i for i, s in enumerate(sched) if s.samples]
        now = time.monotonic()
        for s in sched:
            if s.seq.metrics.first_scheduled_time is None:
                s.seq.metrics.first_scheduled_time = now
        return items, rows

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
            self.sampler.forget(seq.seq_id)
            self._seqs.pop(seq.request_id, None)
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
        """Release what outlives a step: the tensor-parallel worker processes (no-op at tp 1).
        Idempotent; TP workers are also stopped at interpreter exit."""
        stop = getattr(getattr(self, "runner", None), "shutdown", None)
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
        self.cache_manager.stats.clear()
        self.scheduler.num_preemptions = 0
        self._counters = dict.fromkeys(self._counters, 0)
        self._batch_sizes.clear()
        self._last_batch_size = 0
        self.compression_monitor.reset()

    def stats(self) -> dict[str, Any]:
        cs = self.cache_manager.stats
        batch_sizes, self._batch_sizes = self._batch_sizes, []
        return {
            "kv_cache_usage": self.cache_manager.usage(),
            "kv_blocks_total": self.cache_manager.num_blocks,  # changes when the adaptive pool rule resizes
            "num_running": self.num_running(),
            "num_waiting": self.num_waiting(),
            "prefix_queries_tokens": cs.prefix_queries_tokens,
            "prefix_hits_tokens": cs.prefix_hits_tokens,
            "evictions_by_policy": dict(cs.evictions_by_policy),
            "eviction_policy": self.cache_manager.policy_name,  # the live one (the controller may switch)
            "recomputed_tokens": cs.recomputed_tokens,
            "preemptions": self.scheduler.num_preemptions,
            "last_batch_size": self._last_batch_size,
            "batch_sizes": batch_sizes,
            "compression_error": self.compression_monitor.snapshot(),
            "adaptations": dict(self.controller.counts) if self.controller is not None else {},
            **self._counters,
        }
