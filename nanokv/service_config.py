"""One config per service: CacheConfig, ComputeConfig, GatewayConfig (frozen, validated once).

Each service process builds its own from its own flags (`nanokv cache --help` lists CacheConfig's
settings only). A setting two services read is declared once, in a group both configs inherit:

  KVFormat       cache + compute   the pool's format; must agree (checked when the compute service
                                   attaches to the cache service's pool: nanokv.agreement)
  ServiceProcess cache + compute   where the pool lives, the gateway lease, the /metrics port
  BatchLimits    compute + gateway the batch the gateway may schedule and the compute service sizes
                                   its buffers for (the gateway's may not exceed the compute service's)
  Adaptive       all three         the self-tuning controller runs in the gateway; the cache service
                                   keeps its ghost caches, the compute service its KV-error probe
  Sparsity       cache + compute   block sparsity: the cache service decides which blocks go, the
                                   compute service measures attention mass and makes the INT4 copies;
                                   must agree (checked at attach, like KVFormat)

EngineConfig (nanokv.config) composes the three under the flat names LLM() takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanokv import config_checks as ck
from nanokv.errors import ConfigError


@dataclass(frozen=True)
class KVFormat:
    # tokens per KV block; 0 = auto: 32 where compression stores a layer in 4 bits (the INT4 format's
    # key group: 29.7% of bf16's bytes and 3.36x the tokens at 32, 32.8% and 3.05x at 16), else 16
    block_size: int = 0
    enable_compression: bool = False
    quantization_bitwidth: Any = 8  # 8, 4, or {"default": 4, "layers": {"0": 8, "-1": 8}}

    def _check_kv_format(self) -> None:
        ck.block_size(self.block_size)
        ck.boolean(self, "enable_compression")
        spec = ck.parse_bitwidth(self.quantization_bitwidth)
        object.__setattr__(self, "quantization_bitwidth", spec)
        if self.block_size == 0:
            int4 = self.enable_compression and 4 in (spec["default"], *spec["layers"].values())
            object.__setattr__(self, "block_size", 32 if int4 else 16)

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


@dataclass(frozen=True)
class ServiceProcess:
    device: str = "auto"
    # a gateway silent this long (no plan, no step) is taken for dead: the cache and compute services
    # release every sequence it held (nanokv.lease)
    gateway_lease_s: float = 180.0
    metrics_port: int = 0  # Prometheus /metrics of this service on this port; 0 = off (nanokv.service_metrics)
    metrics_host: str = "127.0.0.1"  # where that endpoint listens (0.0.0.0 in a container scraped from outside)

    def _check_process(self) -> None:
        ck.choice(self, "device", ck.DEVICES)
        ck.seconds(self, "gateway_lease_s")
        ck.port(self, "metrics_port")


@dataclass(frozen=True)
class BatchLimits:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    rpc_timeout_s: float = 60.0  # deadline of every internal RPC (a step included)

    def _check_batch(self) -> None:
        ck.int_range(self, "max_num_seqs", 1, 65536)
        ck.int_range(self, "max_num_batched_tokens", 1)
        ck.seconds(self, "rpc_timeout_s")


@dataclass(frozen=True)
class Adaptive:
    adaptive: bool = False  # self-tuning (off until it proves itself)


@dataclass(frozen=True)
class Sparsity:
    # block sparsity (nanokv.sparsity, docs/quality.md "Block sparsity"): the fraction s in [0, 1) of a
    # long sequence's full blocks that goes (0: off); which go first; the policy's knobs "name=value,..."
    compression_sparsity: float = 0.0
    sparsity_policy: str = "streaming"
    sparsity_options: str = ""

    def _check_sparsity(self) -> None:
        """(after _check_kv_format: quantization_bitwidth parsed)"""
        from nanokv.sparsity import params_of

        params = params_of(self)  # ConfigError naming the field
        if params is not None and params.demotes:
            spec = getattr(self, "quantization_bitwidth", None)
            widths = {spec["default"], *spec["layers"].values()} if isinstance(spec, dict) else set()
            if not getattr(self, "enable_compression", False) or widths != {8}:
                raise ConfigError("sparsity_policy", "hybrid demotes INT8 blocks to INT4 and needs every KV layer at "
                                                     "8 bits: set enable_compression true and quantization_bitwidth 8 "
                                                     "(or use streaming, interval or attention)")

    @property
    def sparsity_params(self) -> Any:
        """nanokv.sparsity.SparsityParams, or None when compression_sparsity is 0."""
        from nanokv.sparsity import params_of

        return params_of(self)


@dataclass(frozen=True)
class CacheConfig(KVFormat, ServiceProcess, Adaptive, Sparsity):
    """`nanokv cache`: blocks, prefix hashes, eviction, the KV pool's storage."""
    enable_prefix_caching: bool = True
    eviction_policy: str = "clock"
    lru_k: int = 2
    prefix_caching_hash_algo: str = "sha256"
    # the ghost caches the adaptive controller's policy rule reads (docs/adaptive.md)
    adaptive_policy_candidates: str = ck.ADAPTIVE_POLICY_CANDIDATES
    # the memory hierarchy below the device pool (docs/hierarchy.md); 0 / None = off
    cpu_offload_bytes: int = 0  # L2: host memory (shared with the compute service) for evicted blocks
    cpu_offload_policy: str = "lru"  # L2's own eviction policy
    # the format L2 stores blocks in, and so L3 and the shared tier (they keep L2's bytes as they are):
    # "pool" (the device pool's own), "int8" or "int4" (quantized on the way down: ~1.9x / ~3x the blocks
    # of a 16-bit pool per byte, at the quality cost of docs/quality.md, "Lower tiers")
    cpu_offload_kv_format: str = "pool"
    disk_cache_dir: str | None = None  # L3: a directory of block files, kept across restarts
    disk_cache_bytes: int = 0  # L3's byte budget
    disk_cache_policy: str = "lru"
    # the shared tier below them: a Valkey/Redis server several replicas use (redis://, rediss:// for TLS)
    remote_cache_url: str | None = None
    remote_cache_ttl_s: int = 3600  # a block not read again for this long is forgotten by the server

    def __post_init__(self) -> None:
        ck.choice(self, "eviction_policy", ck.EVICTION_POLICIES)
        ck.tiers(self)
        ck.choice(self, "prefix_caching_hash_algo", ck.HASH_ALGOS)
        ck.int_range(self, "lru_k", 2, 3)
        ck.boolean(self, "enable_prefix_caching", "adaptive")
        self._check_process()
        self._check_kv_format()
        ck.policy_candidates(self.adaptive_policy_candidates)
        self._check_sparsity()

    @property
    def policy_candidates(self) -> tuple[str, ...]:
        return ck.policy_candidates(self.adaptive_policy_candidates)


@dataclass(frozen=True)
class ComputeConfig(KVFormat, ServiceProcess, BatchLimits, Adaptive, Sparsity):
    """`nanokv compute`: the model, the forward pass, sampling; it sizes the KV pool (it knows the
    weights' and activations' memory) and asks the cache service to allocate it."""
    model: str | None = None  # GGUF file, HF folder, or None for the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    # GGUF Q4_0/Q4_1 weights: "gguf" keeps them packed in 4 bits (CPU, one rank; docs/cpu-decode.md), "none"
    # dequantizes to `dtype` (greedy == HF), "auto" = gguf where it applies, else none
    weight_quantization: str = "none"
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    num_gpu_blocks: int | None = None  # overrides the memory-derived count (on any device)
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # CPU byte budget for KV (default 1 GiB)
    attention_backend: str = "auto"
    enforce_eager: bool = False
    # Triton kernel overrides for whole-benchmark A/B runs: "name=value,..." of TritonConfig's
    # int/bool fields (kernels/triton_config.py, docs/kernels.md); "" = the measured defaults
    kernel_options: str = ""
    # CPU torch backend: every token computed by the same float operations whatever shares its step
    # (chunking, prefix hits, batch size, preemption): kernels/cpu_invariant.py.
    # None = on for a compressed cache on the CPU, where rounding otherwise changes greedy tokens
    batch_invariant: bool | None = None
    tensor_parallel_size: int = 1
    # device memory left free after a pool grow or KV widening (CUDA): the adaptive controller's limit
    adaptive_pool_margin_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ConfigError("model", f"got {self.model!r}; a GGUF file, an HF folder, random:NAME, or null "
                                       "(the embedded SmolLM2-135M-Instruct)")
        ck.choice(self, "dtype", ck.DTYPES)
        ck.choice(self, "attention_backend", ck.ATTENTION_BACKENDS)
        ck.choice(self, "weight_quantization", ck.WEIGHT_QUANTIZATIONS)
        ck.int_range(self, "num_gpu_blocks", 1, allow_none=True)
        ck.int_range(self, "kv_cache_memory_bytes", 1, allow_none=True)
        ck.int_range(self, "max_model_len", 1, allow_none=True)
        ck.int_range(self, "tensor_parallel_size", 1, 64)
        ck.int_range(self, "seed", 0)
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not (
                0.0 < float(self.gpu_memory_utilization) <= 1.0):
            raise ConfigError("gpu_memory_utilization", f"got {self.gpu_memory_utilization!r}; must be in (0, 1]")
        ck.optional_boolean(self, "batch_invariant")
        ck.boolean(self, "enforce_eager", "adaptive")
        if not isinstance(self.kernel_options, str):
            raise ConfigError("kernel_options", f"got {self.kernel_options!r}; a string 'name=value,...' of "
                                                "TritonConfig fields, or '' (the defaults)")
        v = self.adaptive_pool_margin_bytes
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError("adaptive_pool_margin_bytes", f"got {v!r}; must be an integer >= 0")
        self._check_process()
        self._check_batch()
        self._check_kv_format()
        self._check_sparsity()


@dataclass(frozen=True)
class GatewayConfig(BatchLimits, Adaptive):
    """`nanokv gateway`: requests, tokenization, the scheduler, the adaptive controller. (The HTTP
    server's own settings, API keys among them, are flags of `nanokv serve`/`gateway`, not config keys.)"""
    # the model expected of the compute service (its tokenizer comes from there): refused at attach if it
    # serves another; None: whichever it serves. In one process: the model loaded
    model: str | None = None
    enable_chunked_prefill: bool = True
    # host schedules step N+1 while the device runs step N (gateway/async_step.py);
    # None = on where it pays: a CUDA device, one process, no in-process adaptive controller
    async_scheduling: bool | None = None
    # services (docs/services.md): None = in this process; else the address of a running
    # `nanokv cache` / `nanokv compute` ("unix:/path.sock" or "127.0.0.1:PORT"); both or neither
    cache_address: str | None = None
    compute_address: str | None = None
    adaptive_mode: str = "act"  # "act" or "recommend"
    # controller thresholds (nanokv/adaptive, docs/adaptive.md); a window is also the hysteresis unit:
    # at most one adaptation per rule per window
    adaptive_window_steps: int = 64
    adaptive_hit_rate_threshold: float = 0.85  # "falling": window hit rate < this x the previous window's
    adaptive_policy_switch_margin: float = 0.01  # best ghost policy must beat the active one by this
    adaptive_policy_candidates: str = ck.ADAPTIVE_POLICY_CANDIDATES
    adaptive_compression_error_bound: float = 1.0  # RMS attention-logit error of a layer's stored keys
    adaptive_preemption_threshold: int = 1  # preemptions per window that lower max_num_seqs
    # KV pool grow / shrink (docs/adaptive.md, "KV pool size"): grow by a step under pressure while
    # memory is left, back to the start-up size when idle
    adaptive_pool_reserve_bytes: int | None = None  # most the pool may grow by; None: CUDA free memory
    adaptive_pool_margin_bytes: int = 2 << 30  # CUDA: device memory left free after a pool grow or KV widening
    adaptive_pool_grow_fraction: float = 0.25  # one grow adds this fraction of the start-up block count
    adaptive_pool_high_usage: float = 0.9  # pressure: peak used blocks >= this x pool with requests waiting
    adaptive_pool_idle_usage: float = 0.5  # idle: peak used blocks < this x the start-up size, none waiting

    def __post_init__(self) -> None:
        ck.choice(self, "adaptive_mode", ("act", "recommend"))
        ck.boolean(self, "enable_chunked_prefill", "adaptive")
        ck.optional_boolean(self, "async_scheduling")
        self._check_batch()
        self._check_addresses()
        for name in ("adaptive_window_steps", "adaptive_preemption_threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(name, f"got {v!r}; must be an integer >= 1")
        ck.number(self, "adaptive_hit_rate_threshold", 0.0, 1.0, True, False)
        ck.number(self, "adaptive_policy_switch_margin", 0.0, 1.0, False, True)
        ck.number(self, "adaptive_compression_error_bound", 0.0, float("inf"), True, True)
        self._check_pool()
        ck.policy_candidates(self.adaptive_policy_candidates)

    def _check_addresses(self) -> None:
        for name in ("cache_address", "compute_address"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ConfigError(name, f"got {v!r}; a gRPC address such as unix:/tmp/nanokv/cache.sock or "
                                        "127.0.0.1:50061, or null (in this process)")
        if (self.cache_address is None) != (self.compute_address is None):
            missing = "compute_address" if self.compute_address is None else "cache_address"
            raise ConfigError(missing, "cache_address and compute_address go together: set both (services in "
                                       "other processes) or neither (in this process)")

    def _check_pool(self) -> None:
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

    @property
    def remote(self) -> bool:
        """The gateway talks to cache and compute services in other processes, over gRPC."""
        return self.cache_address is not None

    @property
    def policy_candidates(self) -> tuple[str, ...]:
        return ck.policy_candidates(self.adaptive_policy_candidates)
