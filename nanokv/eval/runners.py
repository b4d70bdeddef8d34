"""One engine (model, tokenizer, cache manager) and one ModelRunner per KV setting, sharing the model.

The reference runner is the engine's own (full-precision cache). Each setting gets a ModelRunner
with its own KV tensors built from its own EngineConfig, over the same model weights and the same
number of blocks, so one block table from `eng.cache_manager` is valid for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanokv.config import EngineConfig
from nanokv.eval.settings import Setting
from nanokv.kv.monitor import CompressionMonitor
from nanokv.kv.rotation import rotates


@dataclass
class Bench:
    engine: Any  # nanokv.engine.engine.Engine (full-precision cache: the reference)
    runners: dict[str, Any]  # setting name -> ModelRunner
    monitors: dict[str, CompressionMonitor]


def build(settings: list[Setting], model: str | None, num_blocks: int, block_size: int,
          max_model_len: int, extra: dict[str, Any] | None = None) -> Bench:
    from nanokv.engine.engine import Engine
    from nanokv.runner.model_runner import ModelRunner

    base = {"model": model, "num_gpu_blocks": num_blocks, "block_size": block_size, "device": "cpu",
            "max_model_len": max_model_len, "enable_prefix_caching": False, **(extra or {})}
    eng = Engine(EngineConfig.from_kwargs(**base))
    runners: dict[str, Any] = {}
    monitors: dict[str, CompressionMonitor] = {}
    for s in settings:
        cfg = EngineConfig.from_kwargs(**base, **s.engine_kwargs())
        r = ModelRunner(cfg, eng.model, eng.model_config, eng.device, eng.dtype)
        for c in r.kv_caches:
            c.rotate = rotates(c.bits, s.rotate)
            c.fake_quant = s.fake_quant
        monitors[s.name] = CompressionMonitor(every=4).attach(r.kv_caches)
        runners[s.name] = r
    return Bench(eng, runners, monitors)
