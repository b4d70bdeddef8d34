"""Eviction-policy registry: ``make_policy(name, capacity, **kw)``.

Modules are imported on first use so that a broken or slow policy never costs the others.

Every online policy except ``lru`` and ``leaf_lru`` has a caveat: a realistic workload on which it
keeps fewer blocks than plain LRU (docs/cache-policies.md, "Results"). Building one issues a
``PolicyCaveatWarning`` (once per policy and process) that says where.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
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
# Where each policy loses to LRU in `python -m nanokv_tools.sim.suite` (block hit ratio, x LRU's). Keep in step
# with docs/cache-policies.md; tests/test_cache_policies_suite.py checks the claims that matter.
CAVEATS: dict[str, str] = {
    "clock": "below LRU on shared prompts at 1% (0.95x), on the Mooncake trace at 10% (0.96x) and on "
             "long-context chat at 10% (0.99x)",
    "lru_k": "below LRU on multi-turn chat (0.90x at 5%) and long-context chat (0.84x at 10%): one reference "
             "is not enough to protect a conversation's newest turn",
    "arc": "below LRU on multi-turn chat in the legacy multi_turn workload (0.97x at 10%), long-context chat "
           "and the mixed phases workload (0.98x at 25%)",
    "s3fifo": "below LRU on multi-turn chat (0.93x at 5%) and long-context chat (0.87x at 5-10%): the small "
              "FIFO evicts a new turn before the user comes back",
    "sieve": "far below LRU on multi-turn chat (0.66x at 5%) and long-context chat (0.62x at 10%): its hand "
             "evicts a new turn's blocks, never hit yet, before the user comes back",
    "depth_lru": "retired: below LRU on multi-turn chat at 1% (0.95x here, 0.66x on a held-out real trace); "
                 "use leaf_lru",
}


class PolicyCaveatWarning(UserWarning):
    """The eviction policy loses to LRU on a realistic workload (see docs/cache-policies.md)."""


_warned: set[str] = set()


def policy_caveat(name: str) -> str | None:
    return CAVEATS.get(name)


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
    policy = cls(capacity, **{k: v for k, v in kw.items() if k in accepted})
    caveat = CAVEATS.get(name)
    if caveat is not None and name not in _warned:
        _warned.add(name)
        warnings.warn(f"eviction policy {name!r}: {caveat} (docs/cache-policies.md); leaf_lru never was",
                      PolicyCaveatWarning, stacklevel=2)
    return policy


__all__ = ["CAVEATS", "EvictionPolicy", "ONLINE_POLICY_NAMES", "POLICY_NAMES", "PolicyCaveatWarning", "make_policy",
           "policy_caveat", "policy_class"]
