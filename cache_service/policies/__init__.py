"""Eviction-policy registry: ``make_policy(name, capacity, **kw)``.

Modules are imported on first use so that a broken or slow policy never costs the others.

Every online policy except ``lru`` and ``leaf_lru`` has a caveat: a realistic workload on which it
keeps fewer blocks than plain LRU (docs/cache-policies.md, "Results"). The caveats are information,
not alarms: they are in the docs, in ``--eviction-policy``'s help (``policy_help()``) and once in
``nanokv simulate``'s summary. Building a policy is silent, so the default configuration starts
without a warning; only a *retired* policy (``RETIRED``), which a user must have named on purpose,
issues a ``PolicyCaveatWarning`` (once per policy and process), because that choice should change.
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
# Where each policy loses to LRU in `python -m nanokv_tools.sim.suite` (block hit ratio, x LRU's), one line
# each (they make up the --eviction-policy help). Keep in step with docs/cache-policies.md, "Results";
# tests/tools/test_cache_policies_suite.py checks the claims that matter.
CAVEATS: dict[str, str] = {
    "clock": "below LRU on shared prompts at 1% (0.95x) and on the Mooncake trace at 10% (0.96x)",
    "lru_k": "below LRU on multi-turn chat (0.90x at 5%), as one reference does not protect a "
             "conversation's newest turn",
    "arc": "below LRU on the mixed phases workload (0.98x at 25%) and on long-context chat",
    "s3fifo": "below LRU on multi-turn chat (0.93x at 5%), as its small FIFO evicts a new turn before "
              "the user comes back",
    "sieve": "far below LRU on multi-turn chat (0.66x at 5%), as its hand evicts a new turn's blocks "
             "before the user comes back",
    "depth_lru": "retired, below LRU on multi-turn chat (0.95x at 1%, 0.66x on a held-out real trace); "
                 "use leaf_lru",
}
# What the policies without a caveat are, for the help text.
_ABOUT = {
    "lru": "the baseline",
    "leaf_lru": "LRU that evicts a released prompt's dead last block first, never below LRU on the simulator's "
                "workloads",
}
# Kept only so that configurations naming them still load; choosing one warns.
RETIRED: frozenset[str] = frozenset({"depth_lru"})


class PolicyCaveatWarning(UserWarning):
    """A retired eviction policy was chosen: it loses to LRU on a realistic workload and a better one
    replaces it (see docs/cache-policies.md)."""


_warned: set[str] = set()


def policy_caveat(name: str) -> str | None:
    return CAVEATS.get(name)


def policy_help() -> str:
    """The --eviction-policy flag's help: every policy the engine takes, each with its caveat ('%'
    doubled for argparse)."""
    from nanokv.config import ADAPTIVE_START_POLICY
    from nanokv.service_config import CacheConfig

    default = CacheConfig().eviction_policy
    items = [f"{n}: {_ABOUT.get(n) or CAVEATS[n]}" for n in ONLINE_POLICY_NAMES]
    items.append(f"adaptive: starts on {ADAPTIVE_START_POLICY}, switches to the policy whose ghost cache "
                 "would have hit more")
    text = f"prefix-cache eviction policy (default {default}; docs/cache-policies.md). " + "; ".join(items)
    return text.replace("%", "%%")


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
    if name in RETIRED and name not in _warned:
        _warned.add(name)
        warnings.warn(f"eviction policy {name!r} is {CAVEATS[name]} (docs/cache-policies.md)",
                      PolicyCaveatWarning, stacklevel=2)
    return policy


__all__ = ["CAVEATS", "EvictionPolicy", "ONLINE_POLICY_NAMES", "POLICY_NAMES", "PolicyCaveatWarning", "RETIRED",
           "make_policy", "policy_caveat", "policy_class", "policy_help"]
