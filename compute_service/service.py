"""ComputeService: the model's weights, the forward pass and sampling, on the cache service's pool.

At start it loads the model, sizes the KV pool, asks the cache service for it (attach_pool:
a direct call in-process, the Attach RPC across processes) and maps it; then, every step, it
takes a StepRequest (nanokv.messages) and returns the sampled tokens. It keeps, per sequence,
what a step sends only as deltas: the block table and the sampling params (and the sampler's
seeded generators).

launch/collect split a step in two for the pipelined (async) gateway: launch runs the forward
pass and sampling and starts the copy of the sampled ids to the host; collect waits for it. The
sampled ids also stay on the device, where the next step's PLACEHOLDER inputs are fed from.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from nanokv.compute_service.adaptive_hooks import (
    attach_error_probe,
    check_repool_memory,
    kv_bytes_per_block,
    make_error_probe,
)
from nanokv.compute_service.runner.model_runner import ModelRunner, resolve_device, resolve_dtype
from nanokv.compute_service.runner.sampler import Sampler
from nanokv.compute_service.runner.tier_copies import HostTier, run_copies
from nanokv.compute_service.runner.tp_protocol import TokenWindow
from nanokv.compute_service.sparsity.compute_hook import attach as attach_sparsity
from nanokv.compute_service.step_io import HostCopies, Launched
from nanokv.compute_service.step_trace import forward_span
from nanokv.compute_service.warmup import warm_logits
from nanokv.config import ComputeConfig
from nanokv.errors import NanoKVError, PreconditionError
from nanokv.kv.monitor import CompressionMonitor
from nanokv.messages import (
    PLACEHOLDER,
    ComputeServiceStats,
    ModelInfo,
    PoolHandle,
    PoolLayout,
    StepRequest,
    StepResult,
)
from nanokv.sampling import SamplingParams
from nanokv.service_api import PendingStep

log = logging.getLogger(__name__)


class ComputeService:
    """nanokv.service_api.ComputeAPI in process (and behind the gRPC server)."""

    def __init__(self, config: ComputeConfig, attach_pool: Callable[[PoolLayout], PoolHandle] | None = None,
                 error_probe: bool = False, free_segment: Callable[[int], None] | None = None):
        """free_segment: the in-process cache service's free_storage (KVPool._moved_out).
        error_probe: measure the KV-width errors the adaptive controller's width rule reads
        (probe_errors; the gRPC server, when that rule is on: in process the controller hooks its own)."""
        from nanokv.compute_service.model.loader import load_model, random_model

        self.config = cfg = config
        torch.manual_seed(cfg.seed)
        self._attach_pool = attach_pool
        self.device = resolve_device(cfg)
        self.dtype = resolve_dtype(cfg, self.device)
        tp = cfg.tensor_parallel_size  # this process is TP rank 0: it loads rank 0's shard
        if cfg.model is not None and cfg.model.startswith("random:"):
            self.model, self.model_config = random_model(cfg.model[len("random:"):], self.dtype, self.device,
                                                         seed=cfg.seed, tp_size=tp)
        else:
            self.model, self.model_config = load_model(cfg.model, self.dtype, self.device, tp_size=tp,
                                                       weight_quantization=cfg.weight_quantization)
        self.model_name = cfg.model or "SmolLM2-135M-Instruct"
        mc = self.model_config
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.runner: Any  # ModelRunner, or TPModelRunner (a drop-in that forwards to rank 0's runner)
        if tp > 1:
            from nanokv.compute_service.runner.tp_runner import TPModelRunner  # starts ranks 1..tp-1

            self.runner = TPModelRunner(cfg, self.model, mc, self.device, self.dtype, attach_pool=attach_pool,
                                        free_segment=free_segment)
        else:
            self.runner = ModelRunner(cfg, self.model, mc, self.device, self.dtype, attach_pool=attach_pool,
                                      free_segment=free_segment)
            self.runner.fold_value_rotations()  # (this service owns the model; tensor parallel keeps the GEMMs)
        # block sparsity: the attention probe, the INT4 demotion store (None when compression_sparsity is 0);
        # before the capture, so hybrid's decode graphs are captured once, on the layers that read the store
        self.sparsity = attach_sparsity(cfg, self.runner)
        self.runner.capture_cudagraphs(self.max_model_len)
        # running K/V quantization error per layer (sampled on eager steps), read by stats()
        self.compression_monitor = CompressionMonitor().attach(self.runner.layer_hooks)
        self.error_probe = make_error_probe(cfg, self.runner) if error_probe else None
        self.sampler = Sampler(self.device)
        self._tables: dict[int, list[int]] = {}
        self._params: dict[int, SamplingParams] = {}
        self._last: tuple[torch.Tensor, dict[int, int]] | None = None  # previous step's samples on the device
        self._host = HostCopies(cfg.max_num_seqs)  # where the sampled ids land on the host
        self._next_step = 0
        self._l2: HostTier | None = None  # the host tier's tensors (_host_tier)
        self.forward_ns = 0
        self.steps = 0
        stage = getattr(self.runner, "stage", None)
        if stage is not None:  # int4 staging may reclaim slots of open blocks no sequence holds any more
            stage.block_free = self._block_free
        self._gc_freezes = 2 if self.device.type == "cuda" else 0
        if self.device.type == "cuda":  # page-locking a large host tier takes seconds: now, not in a step
            self._host_tier()
        warm_logits(self)

    # ---- what the gateway asks once ----------------------------------------------------------------
    def info(self) -> ModelInfo:
        mc = self.model_config
        return ModelInfo(self.model_name, mc.vocab_size, list(mc.eos_token_ids or []), self.max_model_len,
                         self.runner.num_blocks, self.runner.block_size, self.device.type,
                         str(self.dtype).removeprefix("torch."), model=self.config.model,
                         epoch=getattr(self.runner, "pool_epoch", 0),
                         layer_bits=list(getattr(self.runner, "layer_bits", [])))

    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer as the files save_pretrained writes (empty for random-weight models)."""
        import tempfile

        from nanokv.model_files import load_tokenizer

        if self.config.model is not None and self.config.model.startswith("random:"):
            return {}
        tok = load_tokenizer(self.config.model)
        with tempfile.TemporaryDirectory() as d:
            tok.save_pretrained(d)
            return {name: open(os.path.join(d, name), "rb").read() for name in sorted(os.listdir(d))
                    if os.path.isfile(os.path.join(d, name))}

    def stats(self) -> ComputeServiceStats:
        return {"compression_error": self.compression_monitor.snapshot(), "compute_steps": self.steps,
                "forward_s": self.forward_ns / 1e9, "num_seqs": len(self._tables),
                "epoch": getattr(self.runner, "pool_epoch", 0),
                "device_free_bytes": torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0,
                "kv_bytes_per_block": kv_bytes_per_block(self.runner)}

    def probe_errors(self) -> dict[int, dict[int, float]]:
        """{layer: {bits: RMS attention-logit error}} since the last call ({} without the probe)."""
        return self.error_probe.window_errors() if self.error_probe is not None else {}

    def reset_stats(self) -> None:
        self.compression_monitor.reset()
        self.steps = 0
        self.forward_ns = 0

    def drop_sequences(self) -> None:
        """Forget every sequence's table, params and sampler state (their gateway is gone)."""
        for seq_id in list(self._params):
            self.sampler.forget(seq_id)
        self._tables.clear()
        self._params.clear()
        self._last = None

    def reset(self) -> None:
        """A gateway starts over (Compute.Reset): no sequence, and steps count from 0 again."""
        self.drop_sequences()
        self._next_step = 0

    def repool(self, num_blocks: int | None = None, layer_bits: list[int] | None = None) -> ModelInfo:
        """A pool change (Compute.Repool): every sequence goes (the gateway took them back, to be
        recomputed), the runner attaches a pool of the new layout and captures its graphs again."""
        if self._attach_pool is None or not getattr(self.runner, "follows_cache_pool", True):
            raise PreconditionError("compute", "this compute service cannot change its pool (no cache service "
                                               "attach, or tensor-parallel ranks started by torchrun)")
        if self.sparsity is not None:  # (its probe and demotion store are built on the pool at start-up)
            raise PreconditionError("repool", "not with block sparsity (compression_sparsity > 0)")
        n, bits = self.runner.check_repool(num_blocks, layer_bits)  # a bad layout changes nothing
        check_repool_memory(self.config, self.runner, n, bits)  # nor one the device cannot hold
        self.drop_sequences()
        self.runner.repool(self._attach_pool, num_blocks, layer_bits)
        stage = getattr(self.runner, "stage", None)
        if stage is not None:
            stage.block_free = self._block_free
        self.compression_monitor = CompressionMonitor().attach(self.runner.layer_hooks)
        if self.error_probe is not None:  # the new layers are measured as the old ones were
            attach_error_probe(self.error_probe, self.runner.layer_hooks)
        if self.device.type == "cuda":
            self._host_tier()
        return self.info()

    def _block_free(self, block: int) -> bool:
        return all(block not in t for t in self._tables.values())

    # ---- one step -----------------------------------------------------------------------------------
    def _apply(self, req: StepRequest) -> None:
        for seq_id, params in req.new_seqs:
            self._params[seq_id] = params
        for seq_id in req.finished:
            self._tables.pop(seq_id, None)
            self._params.pop(seq_id, None)
            self.sampler.forget(seq_id)
        for seq_id in req.preempted:
            self._tables.pop(seq_id, None)
        for d in req.tables:
            t = self._tables.setdefault(d.seq_id, [])
            del t[d.start:]
            t.extend(d.blocks)
        if req.demotions:  # hybrid sparsity: before this step's forward pass may write the blocks again
            if self.sparsity is None:
                raise NanoKVError("demotions", "this compute service runs without block sparsity")
            self.sparsity.demote(req.demotions)

    def _freeze_gc(self) -> None:
        """At the first two steps (the second one catches what the first step's torch.compile made):
        move every object alive now (model, compiled graphs: millions after torch.compile) out of the
        cyclic GC's reach, as vLLM does after start-up; a full collection would otherwise walk them
        all again, stalling the host at random steps. CUDA only: frozen objects are never collected."""
        self._gc_freezes -= 1
        gc.collect()
        gc.freeze()

    def launch(self, request: StepRequest) -> PendingStep:
        """The forward pass and sampling launched; the sampled ids are on their way to the host (a
        Launched: collect, or its wait(), reads them)."""
        with forward_span(self, request):  # a child of the gateway's step span when tracing is on
            return self._launch(request)

    @torch.inference_mode()
    def _launch(self, req: StepRequest) -> Launched:
        if self._gc_freezes:
            self._freeze_gc()
        if req.step_id != self._next_step:
            raise NanoKVError("step_id", f"got step {req.step_id}, expected {self._next_step}")
        self._next_step += 1
        self._apply(req)
        if self._l2 is not None:
            self._l2.flush()  # the previous steps' write-backs land in their host slots
        if req.copies:  # the memory hierarchy's moves, before anything reads or writes those blocks
            run_copies(req.copies, self.runner.kv_caches, self._host_tier(), self.runner.num_blocks)
        if not req.seq_ids:
            return Launched(req.step_id, StepResult(req.step_id))
        t0 = time.perf_counter_ns()
        items = []
        src: list[int] = []
        dst: list[int] = []
        off = 0
        for r, (seq_id, start, n) in enumerate(zip(req.seq_ids, req.num_computed, req.num_new)):
            toks = req.tokens[off:off + n]
            table = self._tables.get(seq_id)
            if table is None:
                raise NanoKVError("seq_ids", f"sequence {seq_id} has no block table here")
            if toks and toks[-1] == PLACEHOLDER:
                row = self._last[1].get(seq_id) if self._last is not None else None
                if row is None:
                    raise NanoKVError("tokens", f"sequence {seq_id}: a placeholder without a previous sample")
                src.append(row)
                dst.append(off + n - 1)
            items.append((TokenWindow(start, toks, start + n), start, n, table, r < req.num_prefills))
            off += n
        feed = (self._last[0], src, dst) if src and self._last is not None else None
        rows = req.sample_rows
        logits = self.runner.execute(items, rows, feed=feed) if feed is not None else self.runner.execute(items, rows)
        self.steps += 1
        # attention / hybrid sparsity: this step's attention mass per block, for the cache service
        scores = self.sparsity.scores(req.seq_ids) if self.sparsity is not None else []
        seq_ids = [req.seq_ids[r] for r in rows]
        params = [self._params[s] for s in seq_ids]
        self._last = None
        if not rows:
            self.forward_ns += time.perf_counter_ns() - t0
            return Launched(req.step_id, StepResult(req.step_id, forward_ns=time.perf_counter_ns() - t0,
                                                    block_scores=scores))
        if logits is None:
            raise RuntimeError("rows to sample got no logits")
        if any(p.logprobs is not None for p in params):
            res = self.sampler(logits, params, seq_ids)
            ns = time.perf_counter_ns() - t0
            self.forward_ns += ns
            return Launched(req.step_id, StepResult(req.step_id, res.token_ids, res.logprobs, ns, block_scores=scores))
        tokens = self.sampler.sample(logits, params, seq_ids)
        self._last = (tokens, {s: r for r, s in enumerate(seq_ids)})
        host, event = self._host.to_host(tokens)
        ns = time.perf_counter_ns() - t0
        self.forward_ns += ns
        return Launched(req.step_id, None, host, event, block_scores=scores)

    def _host_tier(self) -> HostTier | None:
        """The cache service's host tier, mapped once per pool (a re-attach brings a new one)."""
        h = getattr(self.runner, "pool_handle", None)
        if h is None or h.host_tier is None:
            return None
        if self._l2 is None or self._l2.epoch != h.epoch:
            if self._l2 is not None:
                self._l2.close()
            self._l2 = HostTier(h, self.runner.pool_layout, self.device)
        return self._l2

    def collect(self, launched: PendingStep) -> StepResult:
        res = launched.wait()
        if self._l2 is not None:  # the gateway may now tell the cache service this step's slots are settled
            self._l2.flush()
        return res

    def step(self, request: StepRequest) -> StepResult:
        return self.collect(self.launch(request))

    def close(self) -> None:
        """Release what outlives a step: the tensor-parallel worker processes (no-op at tp 1)."""
        stop = getattr(getattr(self, "runner", None), "shutdown", None)
        if stop is not None:
            stop()
