"""Eviction-policy registry: ``make_policy(name, capacity, **kw)``.

Modules are imported on first use so that a broken or slow policy never costs the others.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from nanokv.cache_service.policies.base import EvictionPolicy
from nanokv.errors import NanoKVError

# name -> (module, class). "belady" needs future knowledge (an oracle) and is simulator-only.
_REGISTRY: dict[str, tuple[str, str]] = {
    "lru": ("lru", "LRUPolicy"),
    "lru_k": ("lru_k", "LRUKPolicy"),
    "clock": ("clock", "ClockPolicy"),
    "arc": ("arc", "ARCPolicy"),
    "s3fifo": ("s3fifo", "S3FIFOPolicy"),
    "sieve": ("sieve", "SievePolicy"),
    "depth_lru": ("depth_lru", "DepthLRUPolicy"),
    "leaf_lru": ("leaf_lru", "LeafLRUPolicy"),
    "belady": ("belady", "BeladyPolicy"),
}
POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)
ONLINE_POLICY_NAMES: tuple[str, ...] = tuple(n for n in _REGISTRY if n != "belady")


def policy_class(name: str) -> type[EvictionPolicy]:
    if name not in _REGISTRY:
        raise NanoKVError("eviction_policy", f"got {name!r}; allowed values: {', '.join(POLICY_NAMES)}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(f"nanokv.cache_service.policies.{module}"), cls)  # type: ignore[no-any-return]


def make_policy(name: str, capacity: int, **kw: Any) -> EvictionPolicy:
    """Build policy ``name`` for a pool of ``capacity`` blocks. Keyword arguments the policy does
    not take are ignored (so a caller can always pass e.g. ``k=`` for LRU-K)."""
    cls = policy_class(name)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise NanoKVError("num_blocks", f"got {capacity!r}; must be an integer >= 1")
    accepted = inspect.signature(cls.__init__).parameters
    return cls(capacity, **{k: v for k, v in kw.items() if k in accepted})


__all__ = ["EvictionPolicy", "ONLINE_POLICY_NAMES", "POLICY_NAMES", "make_policy", "policy_class"]
