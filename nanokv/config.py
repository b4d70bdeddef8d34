"""EngineConfig: what LLM() takes: the three services' configs under one set of flat names.

Built once (``EngineConfig.from_kwargs(**kw)`` or ``EngineConfig(**kw)``); unknown keys are rejected
with a suggestion and every value is range-checked by the config of the service that owns it
(nanokv.service_config), so the rest of the code can trust it. A flat name a service shares with
another (block_size: cache and compute) sets both; reading it gives the gateway's, else the cache
service's, else the compute service's value. ``cfg.cache``, ``cfg.compute`` and ``cfg.gateway`` are
what each service runs with. One is no flat name: metrics_port, a service process's own
(`nanokv cache --metrics-port`), means nothing here.
"""

from __future__ import annotations

from typing import Any

from nanokv.config_checks import (  # noqa: F401 - the names callers import from here
    ADAPTIVE_POLICY_CANDIDATES,
    ADAPTIVE_START_POLICY,
    ATTENTION_BACKENDS,
    DEFAULT_CPU_KV_BYTES,
    DEVICES,
    DTYPES,
    EVICTION_POLICIES,
    HASH_ALGOS,
    KV_BITS,
    KV_WIDTHS,
    SPARSITY_POLICIES,
    check_keys,
    keys,
    parse_bitwidth,
)
from nanokv.errors import ConfigError
from nanokv.service_config import CacheConfig, ComputeConfig, GatewayConfig

__all__ = ["EngineConfig", "CacheConfig", "ComputeConfig", "GatewayConfig", "ConfigError", "parse_bitwidth"]

SECTIONS: dict[str, type] = {"gateway": GatewayConfig, "cache": CacheConfig, "compute": ComputeConfig}
# settings of no service, for the services in one process only (name: default); none now: block
# sparsity's are the cache and compute services' own (nanokv.service_config.Sparsity)
IN_PROCESS: dict[str, Any] = {}
# a service process's own settings, meaningless for LLM() (no servers in one process): not flat names
PROCESS_ONLY = ("metrics_port", "metrics_host")


def _owners() -> dict[str, str]:
    """flat name -> the section its value is read from (the first in SECTIONS' order that has it)."""
    owners: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        for name in keys(cls):
            if name not in PROCESS_ONLY:
                owners.setdefault(name, section)
    return owners


OWNERS = _owners()
KEYS = list(dict.fromkeys(n for s in ("compute", "cache", "gateway") for n in keys(SECTIONS[s]) if n in OWNERS)) + [
    *IN_PROCESS]


class EngineConfig:
    """The cache, compute and gateway configs, and the in-process-only settings. Frozen."""

    cache: CacheConfig
    compute: ComputeConfig
    gateway: GatewayConfig
    extra: dict[str, Any]  # free-form knobs code may set; no flag, no check

    def __init__(self, extra: dict[str, Any] | None = None, **kwargs: Any):
        check_keys(kwargs, self.keys())
        sections = {}
        # compute's checks first: model, dtype, device ... as before the split
        for section in ("compute", "cache", "gateway"):
            cls = SECTIONS[section]
            own = set(keys(cls)) - set(PROCESS_ONLY)
            sections[section] = cls(**{k: v for k, v in kwargs.items() if k in own})
        local = {k: kwargs.get(k, d) for k, d in IN_PROCESS.items()}
        self._set(sections["cache"], sections["compute"], sections["gateway"], local, extra)

    def _set(self, cache: CacheConfig, compute: ComputeConfig, gateway: GatewayConfig, local: dict[str, Any],
             extra: dict[str, Any] | None) -> None:
        for name, value in (("cache", cache), ("compute", compute), ("gateway", gateway),
                            ("extra", dict(extra or {})), *local.items()):
            object.__setattr__(self, name, value)
        self._check_in_process()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        return cls(**kwargs)

    @classmethod
    def of(cls, cache: CacheConfig | None = None, compute: ComputeConfig | None = None,
           gateway: GatewayConfig | None = None, **local: Any) -> EngineConfig:
        """From service configs built apart (a section left out: its defaults)."""
        cfg = cls.__new__(cls)
        unknown = set(local) - set(IN_PROCESS)
        if unknown:
            raise ConfigError(sorted(unknown)[0], f"not an in-process setting; allowed: {', '.join(IN_PROCESS)}")
        cfg._set(cache or CacheConfig(), compute or ComputeConfig(), gateway or GatewayConfig(),
                 {k: local.get(k, d) for k, d in IN_PROCESS.items()}, None)
        return cfg

    def with_sections(self, **sections: Any) -> EngineConfig:
        """This config with some service configs replaced (cache=CacheConfig(...), ...)."""
        check_keys(sections, list(SECTIONS))
        cfg = EngineConfig.__new__(EngineConfig)
        parts = {name: sections.get(name, self.__dict__[name]) for name in SECTIONS}
        cfg._set(parts["cache"], parts["compute"], parts["gateway"], {k: self.__dict__[k] for k in IN_PROCESS},
                 self.extra)
        return cfg

    @staticmethod
    def keys() -> list[str]:
        """Every flat name: the compute service's, the cache service's, the gateway's, the in-process ones."""
        return KEYS

    def _check_in_process(self) -> None:
        """The in-process settings (IN_PROCESS) against the rest. Async scheduling goes with anything:
        the adaptive controller (a change of the KV tensors or the pool, in place or through
        Engine.repool, lands the step in flight first), tensor parallelism (rank 0 sends the fed input
        ids to the other ranks), block sparsity (nanokv.cache_service.sparsity.decide: the order)."""

    # ---- the flat names ---------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        section = OWNERS.get(name)
        if section is None or section not in self.__dict__:
            raise AttributeError(f"EngineConfig has no setting {name!r}")
        return getattr(self.__dict__[section], name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"EngineConfig is frozen: build another (EngineConfig.replace(cfg, {name}=...))")

    def replace(self, **changes: Any) -> EngineConfig:
        return EngineConfig(extra=self.extra, **{**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.keys()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EngineConfig) and (self.to_dict(), self.extra) == (other.to_dict(), other.extra)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"EngineConfig(cache={self.cache!r}, compute={self.compute!r}, gateway={self.gateway!r})"

    # ---- derived ----------------------------------------------------------------------------
    @property
    def policy_candidates(self) -> tuple[str, ...]:
        """adaptive_policy_candidates as names (validated at construction)."""
        return self.gateway.policy_candidates

    @property
    def remote(self) -> bool:
        """The gateway talks to cache and compute services in other processes, over gRPC."""
        return self.gateway.remote

    def layer_bits(self, num_layers: int) -> list[int]:
        """The per-layer KV bit plan (16 = full precision), fixed at start-up."""
        return self.cache.layer_bits(num_layers)
