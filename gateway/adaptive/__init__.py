"""Self-tuning: a controller in the engine loop that reads windowed figures and adapts the engine.

Torch-free modules (usable by ``nanokv simulate``): settings, window, ghosts, rules, controller,
replay, plot. Torch modules (engine only): probe, reformat, precision, engine_glue, and the
``python -m nanokv.eval.adaptive_quality`` measurement.
See docs/adaptive.md.
"""

from nanokv.gateway.adaptive.controller import AdaptiveController, Decision
from nanokv.gateway.adaptive.settings import AdaptiveSettings

__all__ = ["AdaptiveController", "AdaptiveSettings", "Decision"]
