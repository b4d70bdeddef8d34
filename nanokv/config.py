"""EngineConfig: the one typed, validated configuration object.

Built once (``EngineConfig.from_kwargs(**kw)``); unknown keys are rejected with a suggestion and
every value is range-checked here so the rest of the code can trust it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
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


def _power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass
class EngineConfig:
    # model
    model: str | None = None  # GGUF file, HF folder, or None for the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # GGUF Q4_0/Q4_1 weights: "gguf" keeps them packed in 4 bits (CPU, one rank; docs/cpu-decode.md), "none"
    # dequantizes to `dtype` (greedy == HF, equal across TP sizes and devices), "auto" = gguf where it applies
    weight_quantization: str = "none"
    # paged KV cache
    # tokens per KV block; 0 = auto: 32 where compression stores a layer in 4 bits (the INT4 format's
    # key group: 29.7% of bf16's bytes and 3.36x the tokens at 32, 32.8% and 3.05x at 16), else 16
    block_size: int = 0
    num_gpu_blocks: int | None = None  # overrides the memory-derived count (on any device)
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # CPU byte budget for KV (default 1 GiB)
    # scheduler
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    enable_chunked_prefill: bool = True
    # prefix cache
    enable_prefix_caching: bool = True
    eviction_policy: str = "clock"
    lru_k: int = 2
    prefix_caching_hash_algo: str = "sha256"
    # compression
    enable_compression: bool = False
    quantization_bitwidth: Any = 8  # 8, 4, or {"default": 4, "layers": {"0": 8, "-1": 8}}
    compression_sparsity: float = 0.0
    sparsity_policy: str = "streaming"
    # execution
    attention_backend: str = "auto"
    enforce_eager: bool = False
    # Triton kernel overrides for whole-benchmark A/B runs: "name=value,..." of TritonConfig's
    # int/bool fields (kernels/triton_config.py, docs/kernels.md); "" = the measured defaults
    kernel_options: str = ""
    # CPU torch backend: every token computed by the same float operations whatever shares its step
    # (chunking, prefix hits, batch size, preemption): kernels/cpu_invariant.py.
    # None = on for a compressed cache on the CPU, where rounding otherwise changes greedy tokens
    batch_invariant: bool | None = None
    # host schedules step N+1 while the device runs step N (gateway/async_step.py);
    # None = on where it pays: a CUDA device, one process, no sparsity, no in-process adaptive controller
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    # services (docs/services.md): None = in this process; else the address of a running
    # `nanokv cache` / `nanokv compute` ("unix:/path.sock" or "127.0.0.1:PORT"); both or neither
    cache_address: str | None = None
    compute_address: str | None = None
    rpc_timeout_s: float = 60.0  # deadline of every internal RPC (a step included)
    # a gateway silent this long (no plan, no step) is taken for dead: the cache and compute services
    # release every sequence it held (nanokv.lease)
    gateway_lease_s: float = 180.0
    # self-tuning (off until it proves itself)
    adaptive: bool = False
    adaptive_mode: str = "act"  # "act" or "recommend"
    # controller thresholds (nanokv/adaptive, docs/adaptive.md); a window is also the hysteresis unit:
    # at most one adaptation per rule per window
    adaptive_window_steps: int = 64
    adaptive_hit_rate_threshold: float = 0.85  # "falling": window hit rate < this x the previous window's
    adaptive_policy_switch_margin: float = 0.01  # best ghost policy must beat the active one by this
    adaptive_policy_candidates: str = ADAPTIVE_POLICY_CANDIDATES
    adaptive_compression_error_bound: float = 1.0  # RMS attention-logit error of a layer's stored keys
    adaptive_preemption_threshold: int = 1  # preemptions per window that lower max_num_seqs
    # KV pool grow / shrink (docs/adaptive.md, "KV pool size"): grow by a step under pressure while
    # memory is left, back to the start-up size when idle
    adaptive_pool_reserve_bytes: int | None = None  # most the pool may grow by; None: CUDA free memory
    adaptive_pool_margin_bytes: int = 2 << 30  # CUDA: device memory left free after a pool grow or KV widening
    adaptive_pool_grow_fraction: float = 0.25  # one grow adds this fraction of the start-up block count
    adaptive_pool_high_usage: float = 0.9  # pressure: peak used blocks >= this x pool with requests waiting
    adaptive_pool_idle_usage: float = 0.5  # idle: peak used blocks < this x the start-up size, none waiting
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, sorted(names), n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ConfigError(key, f"unknown config key{hint} Allowed keys: {', '.join(sorted(names))}")
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        def choice(name: str, allowed: tuple[str, ...]) -> None:
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(name, f"got {value!r}; allowed values: {', '.join(allowed)}")

        def int_range(name: str, lo: int, hi: int | None = None, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(name, f"must be an integer, got {value!r}")
            if value < lo or (hi is not None and value > hi):
                bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
                raise ConfigError(name, f"got {value}; must be {bound}")

        choice("dtype", DTYPES)
        choice("device", DEVICES)
        choice("weight_quantization", WEIGHT_QUANTIZATIONS)
        choice("eviction_policy", EVICTION_POLICIES)
        choice("sparsity_policy", SPARSITY_POLICIES)
        choice("prefix_caching_hash_algo", HASH_ALGOS)
        choice("attention_backend", ATTENTION_BACKENDS)
        choice("adaptive_mode", ("act", "recommend"))
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or (self.block_size != 0 and (
                not _power_of_two(self.block_size) or not 8 <= self.block_size <= 256)):
            raise ConfigError("block_size", f"got {self.block_size!r}; allowed: a power of two from 8 to 256, "
                                            "or 0 (auto)")
        int_range("num_gpu_blocks", 1, allow_none=True)
        int_range("kv_cache_memory_bytes", 1, allow_none=True)
        int_range("max_num_seqs", 1, 65536)
        int_range("max_num_batched_tokens", 1)
        int_range("max_model_len", 1, allow_none=True)
        int_range("tensor_parallel_size", 1, 64)
        int_range("seed", 0)
        int_range("lru_k", 2, 3)
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not (
            0.0 < float(self.gpu_memory_utilization) <= 1.0
        ):
            raise ConfigError(
                "gpu_memory_utilization", f"got {self.gpu_memory_utilization!r}; must be in (0, 1]"
            )
        s = self.compression_sparsity
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not (0.0 <= float(s) < 1.0):
            raise ConfigError("compression_sparsity", f"got {s!r}; must be a number in [0, 1)")
        if self.batch_invariant is not None and not isinstance(self.batch_invariant, bool):
            raise ConfigError("batch_invariant", f"must be true, false or null (auto), got {self.batch_invariant!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ConfigError("async_scheduling", f"must be true, false or null (auto), got {self.async_scheduling!r}")
        # (the adaptive controller goes with it: a change of the KV tensors or the pool, in place or
        # through Engine.repool, lands the step in flight first; tensor parallelism too: rank 0 sends
        # the fed input ids to the other ranks)
        if self.async_scheduling and self.compression_sparsity:
            raise ConfigError("async_scheduling", "needs compression_sparsity 0; set it false or null (auto)")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "enable_compression",
                     "enforce_eager", "adaptive"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false, got {getattr(self, name)!r}")
        self._validate_services()
        if not isinstance(self.kernel_options, str):
            raise ConfigError("kernel_options", f"got {self.kernel_options!r}; a string 'name=value,...' of "
                                                "TritonConfig fields, or '' (the defaults)")
        self.quantization_bitwidth = parse_bitwidth(self.quantization_bitwidth)
        if self.block_size == 0:
            spec = self.quantization_bitwidth
            int4 = self.enable_compression and 4 in (spec["default"], *spec["layers"].values())
            self.block_size = 32 if int4 else 16
        self._validate_adaptive()

    def _validate_services(self) -> None:
        for name in ("cache_address", "compute_address"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ConfigError(name, f"got {v!r}; a gRPC address such as unix:/tmp/nanokv/cache.sock or "
                                        "127.0.0.1:50061, or null (in this process)")
        if (self.cache_address is None) != (self.compute_address is None):
            missing = "compute_address" if self.compute_address is None else "cache_address"
            raise ConfigError(missing, "cache_address and compute_address go together: set both (services in "
                                       "other processes) or neither (in this process)")
        t = self.rpc_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 86400:
            raise ConfigError("rpc_timeout_s", f"got {t!r}; must be a number of seconds in (0, 86400]")
        lease = self.gateway_lease_s
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not 0 < lease <= 86400:
            raise ConfigError("gateway_lease_s", f"got {lease!r}; must be a number of seconds in (0, 86400]")
        if self.remote and self.compression_sparsity:
            raise ConfigError("compression_sparsity", "works only with the services in one process (cache_address "
                                                      "and compute_address null): it reaches into all three services")

    @property
    def policy_candidates(self) -> tuple[str, ...]:
        """adaptive_policy_candidates as names (validated at construction)."""
        return tuple(c.strip() for c in self.adaptive_policy_candidates.split(",") if c.strip())

    @property
    def remote(self) -> bool:
        """The gateway talks to cache and compute services in other processes, over gRPC."""
        return self.cache_address is not None

    def _validate_adaptive(self) -> None:
        def number(name: str, lo: float, hi: float, lo_open: bool, hi_open: bool) -> None:
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
            if not ok:
                span = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
                raise ConfigError(name, f"got {v!r}; must be a number in {span}")

        for name in ("adaptive_window_steps", "adaptive_preemption_threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(name, f"got {v!r}; must be an integer >= 1")
        number("adaptive_hit_rate_threshold", 0.0, 1.0, True, False)
        number("adaptive_policy_switch_margin", 0.0, 1.0, False, True)
        number("adaptive_compression_error_bound", 0.0, float("inf"), True, True)
        self._validate_pool()
        cands = self.adaptive_policy_candidates
        names = [c.strip() for c in cands.split(",") if c.strip()] if isinstance(cands, str) else []
        online = [p for p in EVICTION_POLICIES if p != "adaptive"]
        bad = [c for c in names if c not in online]
        if not names or bad:
            raise ConfigError("adaptive_policy_candidates",
                              f"got {cands!r}; a comma list of: {', '.join(online)}")

    def _validate_pool(self) -> None:
        for name, lo, none in (("adaptive_pool_reserve_bytes", 1, True), ("adaptive_pool_margin_bytes", 0, False)):
            v = getattr(self, name)
            if (v is None and not none) or (v is not None and (isinstance(v, bool) or not isinstance(v, int)
                                                               or v < lo)):
                raise ConfigError(name, f"got {v!r}; must be an integer >= {lo}" + (" or null" if none else ""))
        for name, hi in (("adaptive_pool_grow_fraction", 4.0), ("adaptive_pool_high_usage", 1.0),
                         ("adaptive_pool_idle_usage", 1.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= hi:
                raise ConfigError(name, f"got {v!r}; must be a number in (0, {hi:g}]")
        if self.adaptive_pool_idle_usage >= self.adaptive_pool_high_usage:
            raise ConfigError("adaptive_pool_idle_usage",
                              f"got {self.adaptive_pool_idle_usage!r}; must be below adaptive_pool_high_usage "
                              f"({self.adaptive_pool_high_usage!r}) so that grow and shrink cannot alternate")

    # ---- derived ----------------------------------------------------------------------------
    def layer_bits(self, num_layers: int) -> list[int]:
        """The per-layer KV bit plan (16 = full precision), fixed at start-up."""
        if not self.enable_compression:
            return [16] * num_layers
        spec = self.quantization_bitwidth
        bits = [int(spec["default"])] * num_layers
        for key, b in spec["layers"].items():
            idx = int(key)
            if not -num_layers <= idx < num_layers:
                raise ConfigError(
                    "quantization_bitwidth",
                    f"layer {key} out of range for a model with {num_layers} layers "
                    f"(allowed: {-num_layers}..{num_layers - 1})",
                )
            bits[idx] = int(b)
        return bits

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("extra")
        return d


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
