"""Self-tuning: a controller in the engine loop that reads windowed figures and adapts the engine.

Torch-free modules (usable by ``nanokv simulate``): settings, window, rules, controller, remote,
replay, plot (the ghost caches are the cache service's: nanokv.cache_service.ghosts). Torch modules
(engine only): reformat, precision, pool, engine_glue (the error probe is the compute service's), and the
``python -m nanokv_tools.eval.adaptive_quality`` measurement.
See docs/adaptive.md.
"""

from nanokv.gateway.adaptive.controller import AdaptiveController, Decision
from nanokv.gateway.adaptive.settings import AdaptiveSettings

__all__ = ["AdaptiveController", "AdaptiveSettings", "Decision"]
