"""The allowed values of every configuration setting, and the checks that enforce them.

Shared by the per-service configs (nanokv.service_config) and EngineConfig (nanokv.config): each
check names the setting and what is allowed, so a bad value reads the same whichever service's
config or flag carried it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any

from nanokv.errors import ConfigError

KV_WIDTHS = (4, 8, 16)  # KV bit widths, narrowest first; 16 = the model dtype, no compression error
EVICTION_POLICIES = ("lru", "lru_k", "clock", "arc", "s3fifo", "sieve", "depth_lru", "leaf_lru", "adaptive")
# eviction_policy="adaptive" starts on leaf_lru (never below LRU on the workloads of docs/cache-policies.md) and
# keeps ghosts of these; the simulator's "adaptive" replays exactly this pair
ADAPTIVE_START_POLICY = "leaf_lru"
ADAPTIVE_POLICY_CANDIDATES = "leaf_lru,lru_k,arc,s3fifo"
SPARSITY_POLICIES = ("streaming", "interval", "attention", "hybrid")
HASH_ALGOS = ("sha256", "blake2b")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
WEIGHT_QUANTIZATIONS = ("auto", "none", "gguf")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_BITS = (4, 8, 16)  # 16 = full precision (the model dtype) for that layer

DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB of KV on CPU unless told otherwise


def keys(cls: type) -> list[str]:
    """A config class's setting names, in declaration order."""
    return [f.name for f in dataclasses.fields(cls)]


def check_keys(given: Any, names: list[str]) -> None:
    """Refuse a key not in `names` by name, with the closest allowed one and the whole list."""
    for key in given:
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(key, f"unknown config key{hint} Allowed keys: {', '.join(sorted(names))}")


def choice(cfg: Any, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in allowed:
        raise ConfigError(name, f"got {value!r}; allowed values: {', '.join(allowed)}")


def int_range(cfg: Any, name: str, lo: int, hi: int | None = None, allow_none: bool = False) -> None:
    value = getattr(cfg, name)
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise ConfigError(name, f"got {value}; must be {bound}")


def number(cfg: Any, name: str, lo: float, hi: float, lo_open: bool, hi_open: bool) -> None:
    v = getattr(cfg, name)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        span = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ConfigError(name, f"got {v!r}; must be a number in {span}")


def boolean(cfg: Any, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(name, f"must be true or false, got {getattr(cfg, name)!r}")


def optional_boolean(cfg: Any, name: str) -> None:
    v = getattr(cfg, name)
    if v is not None and not isinstance(v, bool):
        raise ConfigError(name, f"must be true, false or null (auto), got {v!r}")


def seconds(cfg: Any, name: str) -> None:
    t = getattr(cfg, name)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 86400:
        raise ConfigError(name, f"got {t!r}; must be a number of seconds in (0, 86400]")


def port(cfg: Any, name: str) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 65535:
        raise ConfigError(name, f"got {v!r}; allowed: a TCP port from 1 to 65535, or 0 (off)")


def block_size(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (value != 0 and (
            value & (value - 1) != 0 or not 8 <= value <= 256)):
        raise ConfigError("block_size", f"got {value!r}; allowed: a power of two from 8 to 256, or 0 (auto)")


def policy_candidates(value: Any) -> tuple[str, ...]:
    """adaptive_policy_candidates ("a,b,...") as names; every one an online eviction policy."""
    names = [c.strip() for c in value.split(",") if c.strip()] if isinstance(value, str) else []
    online = [p for p in EVICTION_POLICIES if p != "adaptive"]
    bad = [c for c in names if c not in online]
    if not names or bad:
        raise ConfigError("adaptive_policy_candidates", f"got {value!r}; a comma list of: {', '.join(online)}")
    return tuple(names)


def parse_bitwidth(value: Any) -> dict[str, Any]:
    """Normalise `quantization_bitwidth` to {"default": b, "layers": {"i": b}}.

    Accepts 8, 4, "8", a dict, or a JSON string of a dict (from the command line).
    """
    allowed = ", ".join(str(b) for b in KV_BITS)
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError("quantization_bitwidth", f"invalid JSON: {e}") from None
        elif text.lstrip("-").isdigit():
            value = int(text)
    if isinstance(value, bool):
        raise ConfigError("quantization_bitwidth", f"got {value!r}; allowed: {allowed} or a per-layer dict")
    if isinstance(value, int):
        if value not in KV_BITS:
            raise ConfigError("quantization_bitwidth", f"got {value}; allowed bit widths: {allowed}")
        return {"default": value, "layers": {}}
    if isinstance(value, dict):
        unknown = set(value) - {"default", "layers"}
        if unknown:
            raise ConfigError(
                "quantization_bitwidth", f"unknown keys {sorted(unknown)}; allowed: 'default', 'layers'"
            )
        default = parse_bitwidth(value.get("default", 8))["default"]
        layers_in = value.get("layers", {}) or {}
        if not isinstance(layers_in, dict):
            raise ConfigError("quantization_bitwidth.layers", "must map layer index to bit width")
        layers: dict[str, int] = {}
        for k, b in layers_in.items():
            try:
                int(k)
            except (TypeError, ValueError):
                raise ConfigError(
                    "quantization_bitwidth.layers", f"layer key {k!r} is not an integer index"
                ) from None
            if isinstance(b, bool) or b not in KV_BITS:
                raise ConfigError(
                    "quantization_bitwidth.layers", f"layer {k}: got {b!r}; allowed bit widths: {allowed}"
                )
            layers[str(int(k))] = int(b)
        return {"default": default, "layers": layers}
    raise ConfigError("quantization_bitwidth", f"got {value!r}; allowed: {allowed} or a per-layer dict")


TIER_POLICIES = tuple(p for p in EVICTION_POLICIES if p not in ("adaptive", "depth_lru"))
# the lower tiers' storage format (nanokv.kv.tier_transcode.TIER_FORMAT_BITS): the pool's own, or narrower
TIER_KV_FORMATS = ("pool", "int8", "int4")


def tiers(cfg: Any) -> None:
    """The lower tiers' settings (CacheConfig): sizes, policies, and L3 only below an L2."""
    int_range(cfg, "cpu_offload_bytes", 0)
    int_range(cfg, "disk_cache_bytes", 0)
    choice(cfg, "cpu_offload_policy", TIER_POLICIES)
    choice(cfg, "cpu_offload_kv_format", TIER_KV_FORMATS)
    if cfg.cpu_offload_kv_format != "pool" and cfg.cpu_offload_bytes == 0:
        raise ConfigError("cpu_offload_kv_format", f"got {cfg.cpu_offload_kv_format!r} with no host tier: "
                                                   "set cpu_offload_bytes > 0, or leave it 'pool'")
    choice(cfg, "disk_cache_policy", TIER_POLICIES)
    d = cfg.disk_cache_dir
    if d is not None and (not isinstance(d, str) or not d.strip()):
        raise ConfigError("disk_cache_dir", f"got {d!r}; a directory path, or null (no disk tier)")
    if (d is None) != (cfg.disk_cache_bytes == 0):
        raise ConfigError("disk_cache_bytes", "the disk tier needs both disk_cache_dir and disk_cache_bytes > 0 "
                                              f"(got dir={d!r}, bytes={cfg.disk_cache_bytes})")
    if d is not None and cfg.cpu_offload_bytes == 0:
        raise ConfigError("disk_cache_dir", "the disk tier (L3) sits below the host tier: set cpu_offload_bytes > 0")
    url = cfg.remote_cache_url
    if url is not None and (not isinstance(url, str) or not url.startswith(("redis://", "rediss://"))):
        raise ConfigError("remote_cache_url", f"got {url!r}; a URL redis://[:password@]host:port/db or rediss://...")
    if url is not None and cfg.cpu_offload_bytes == 0:
        raise ConfigError("remote_cache_url", "the shared tier loads through host memory: set cpu_offload_bytes > 0")
    int_range(cfg, "remote_cache_ttl_s", 1)
    if cfg.cpu_offload_bytes and cfg.adaptive:  # its pool rule resizes L1 under the copies' block ids
        raise ConfigError("cpu_offload_bytes", "lower tiers and the adaptive controller (adaptive) together are "
                                               "not supported yet: turn one off")
    if cfg.cpu_offload_bytes and not cfg.enable_prefix_caching:
        raise ConfigError("cpu_offload_bytes", "lower tiers hold prefix-cache blocks: needs enable_prefix_caching")
