"""One engine (model, tokenizer, cache manager) and one ModelRunner per KV setting, sharing the model.

The reference runner is the engine's own (full-precision cache). Each setting gets a ModelRunner
with its own KV tensors built from its own EngineConfig, over the same model weights and the same
number of blocks, so one block table from `eng.cache_manager` is valid for all of them. A sparse
setting reads that table through its own view with holes (nanokv_tools.eval.sparse); its runner gets an
attention probe when its policy ranks blocks by attention mass, and an INT4 demotion store for hybrid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from nanokv.compute_service.sparsity.accounting import KVBytes
from nanokv.config import EngineConfig
from nanokv.kv.cache import FullKV, LayerKV
from nanokv.kv.fakequant import SimulatedKV
from nanokv.kv.monitor import CompressionMonitor
from nanokv.kv.rotation import rotates
from nanokv_tools.eval.settings import Setting


def setting_layer(c: LayerKV, s: Setting) -> LayerKV:
    """A runner's freshly allocated layer as setting `s` wants it: its key rotation, and on a 16-bit
    layer the simulation of int4's rotated values and the simulated format (SimulatedKV)."""
    c = dataclasses.replace(c, rotate=rotates(c.bits, s.rotate))
    if s.rotate_v and isinstance(c, FullKV):  # simulation of int4's rotated values
        c = dataclasses.replace(c, rotate_v=True)
    if s.fake_quant is not None:
        if not isinstance(c, FullKV):
            raise ValueError(f"setting {s.name!r}: fake_quant simulates a format on a full-precision cache, "
                             f"this layer is {c.bits}-bit")
        c = SimulatedKV.of(c, s.fake_quant)
    return c

@dataclass
class Bench:
    engine: Any  # nanokv.gateway.engine.Engine (full-precision cache: the reference)
    runners: dict[str, Any]  # setting name -> ModelRunner
    monitors: dict[str, CompressionMonitor]
    settings: dict[str, Setting] = field(default_factory=dict)
    kv_bytes: dict[str, KVBytes] = field(default_factory=dict)  # "fp" = the reference, counted as bf16
    # most live KV bytes / blocks one sequence held, per phase and setting ("fp" included), as
    # measured by nanokv_tools.eval.sparse.SparseView
    peak_bytes: dict[str, dict[str, int]] = field(default_factory=lambda: {"perplexity": {}, "passkey": {}})
    peak_blocks: dict[str, dict[str, int]] = field(default_factory=lambda: {"perplexity": {}, "passkey": {}})

    # sparse settings: full blocks / dropped / demoted summed over every step of every sequence, and
    # summed over the last step of every sequence (its end: the steady state of the budget)
    sparse_totals: dict[str, dict[str, int]] = field(default_factory=dict)
    sparse_end: dict[str, dict[str, int]] = field(default_factory=dict)

    def note_peak(self, phase: str, name: str, view: Any) -> None:
        for store, value in ((self.peak_bytes, view.peak_bytes), (self.peak_blocks, view.peak_blocks)):
            store[phase][name] = max(store[phase].get(name, 0), value)
        if view.state is not None:
            tot = self.sparse_totals.setdefault(f"{phase}:{name}", {"full": 0, "dropped": 0, "demoted": 0})
            end = self.sparse_end.setdefault(f"{phase}:{name}", {"full": 0, "dropped": 0, "demoted": 0})
            for k, v in view.totals.items():
                tot[k] += v
                end[k] += view.last[k]


def build(settings: list[Setting], model: str | None, num_blocks: int, block_size: int,
          max_model_len: int, extra: dict[str, Any] | None = None) -> Bench:
    from nanokv.compute_service.runner.model_runner import ModelRunner
    from nanokv.gateway.engine import Engine

    # batch_invariant off for every setting: the fp reference and each compressed cache must run the
    # same attention code (a simulated format scores exactly as the real one), and int4 then reads
    # blocks as the GPU kernels do (docs/quality.md)
    base = {"model": model, "num_gpu_blocks": num_blocks, "block_size": block_size, "device": "cpu",
            "max_model_len": max_model_len, "enable_prefix_caching": False, "batch_invariant": False,
            **(extra or {})}
    eng = Engine(EngineConfig.from_kwargs(**base))
    runners: dict[str, Any] = {}
    monitors: dict[str, CompressionMonitor] = {}
    mc = eng.model_config
    shape = (mc.num_key_value_heads, block_size, mc.head_dim)
    kv_bytes = {"fp": KVBytes([16] * mc.num_hidden_layers, *shape)}
    for s in settings:
        cfg = EngineConfig.from_kwargs(**base, **s.engine_kwargs())
        r = ModelRunner(cfg, eng.model, eng.model_config, eng.device, eng.dtype)
        if r.stage is not None:  # int4 staging: slots of open blocks whose sequence ended may be reclaimed
            r.stage.block_free = lambda b, pool=eng.cache_manager.pool: pool.ref[b] == 0
        for i, c in enumerate(r.kv_caches):
            r.kv_caches[i] = setting_layer(c, s)
        monitors[s.name] = CompressionMonitor(every=4).attach(r.layer_hooks)
        if s.sparsity is not None and s.sparsity.needs_scores:
            from nanokv.compute_service.sparsity.probe import AttentionProbe

            r.attn_probe = AttentionProbe(window=s.sparsity.probe_window)
        if s.sparsity is not None and s.sparsity.demotes:
            from nanokv.kv.demote import DemotionStore

            # one sequence at a time: a slot per block, so the store is never full (ConfigError
            # unless every layer is int8)
            r.demotion_store = DemotionStore(r.kv_caches, r.num_blocks)
        runners[s.name] = r
        kv_bytes[s.name] = KVBytes(r.layer_bits, *shape)
    return Bench(eng, runners, monitors, {s.name: s for s in settings}, kv_bytes)
