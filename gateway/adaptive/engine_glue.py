"""Build the controller an Engine runs (called from Engine.__init__ when adaptive is on).

With the services in other processes the same controller runs over their RPCs
(nanokv.gateway.adaptive.remote). Which rules run:
  * eviction policy - with prefix caching on, when ``adaptive`` is set or ``eviction_policy`` is
    "adaptive" (then it is the only rule, starting from leaf_lru: nanokv.config.ADAPTIVE_START_POLICY);
  * max_num_seqs    - when ``adaptive`` is set;
  * KV bit width    - when ``adaptive`` is set, some layer is compressed, and there is no hybrid
    sparsity (its INT4 demotion store copies from int8 layers and needs them int8). With tensor
    parallelism every rank re-formats its shard in lock step (TPModelRunner.reformat_kv); the probe
    measures rank 0's KV heads;
  * KV pool size    - when ``adaptive`` is set and there is something to grow into: a CUDA device
    or ``adaptive_pool_reserve_bytes``. With tensor parallelism every rank resizes its shard in
    lock step (TPModelRunner.resize_kv); the memory check reads rank 0's device only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from nanokv.config import EngineConfig
from nanokv.gateway.adaptive.controller import AdaptiveController
from nanokv.gateway.adaptive.settings import AdaptiveSettings

if TYPE_CHECKING:
    from nanokv.compute_service.adaptive.pool import PoolActuator
    from nanokv.gateway.engine import Engine

log = logging.getLogger("nanokv.gateway.adaptive")


def build_controller(engine: Engine) -> AdaptiveController:
    cfg = engine.config
    full = bool(cfg.adaptive)
    if engine.local_cache is None:  # the services run apart: the same controller over their RPCs
        from nanokv.gateway.adaptive.remote import remote_parts

        return _log(AdaptiveController(AdaptiveSettings.from_config(cfg), scheduler=engine.scheduler,
                                       concurrency_rule=full, **remote_parts(engine, full)), cfg,
                    "over the services' RPCs")
    precision = None
    runner = engine.runner
    if full and any(b < 16 for b in runner.layer_bits):
        if any(getattr(c, "demoted", None) is not None for c in runner.kv_caches):
            # hybrid sparsity's demotion store re-quantizes int8 blocks: every layer must stay int8
            log.warning("adaptive: KV bit-width switching is off with hybrid sparsity (INT4 demotion store)")
        else:
            from nanokv.compute_service.adaptive.precision import PrecisionActuator  # torch: only when needed

            # (tensor parallel: every rank re-formats in lock step)
            precision = PrecisionActuator(runner, margin_bytes=cfg.adaptive_pool_margin_bytes,
                                          before_change=_lander(engine))
    ctl = AdaptiveController(AdaptiveSettings.from_config(cfg), cache=engine.cache_manager,
                             scheduler=engine.scheduler, precision=precision, pool=_pool_actuator(engine),
                             policy_rule=True, concurrency_rule=full)
    return _log(ctl, cfg, "in process")


def _lander(engine: Engine) -> Callable[[], None]:
    """What an in-process actuator calls right before it changes the KV tensors or the pool: with
    async scheduling the step in flight lands first (its outputs go out with the engine's next step),
    so no launched step runs on tensors that are being replaced."""
    def land() -> None:
        engine.stashed.extend(engine.land())
    return land


def _log(ctl: AdaptiveController, cfg: EngineConfig, where: str) -> AdaptiveController:
    rules = [r.kind for r in (ctl.policy_rule, ctl.concurrency_rule, ctl.precision_rule) if r is not None]
    rules += ["pool"] if ctl.pool_rule is not None else []
    log.info("adaptive controller (%s mode, window %d steps, %s): rules %s", cfg.adaptive_mode,
             cfg.adaptive_window_steps, where, ", ".join(rules) or "none")
    return ctl


def _pool_actuator(engine: Engine) -> PoolActuator | None:
    cfg = engine.config
    if not cfg.adaptive:
        return None
    if engine.device.type != "cuda" and cfg.adaptive_pool_reserve_bytes is None:
        log.info("adaptive: KV pool rule off on %s without adaptive_pool_reserve_bytes (nothing to grow into)",
                 engine.device.type)
        return None
    from nanokv.compute_service.adaptive.pool import PoolActuator  # torch: only when needed

    return PoolActuator(engine.runner, engine.cache_manager, cfg.adaptive_pool_reserve_bytes,
                        cfg.adaptive_pool_margin_bytes, before_change=_lander(engine))
