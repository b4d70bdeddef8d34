"""One config per service: each service's --help lists its own settings only, EngineConfig still takes
every flat name, and settings two services must share are checked when they meet (real processes):
a compute service whose block size or KV format is not the cache service's is refused at attach, and
a gateway that expects another model, or a larger batch than the compute service sized for, is refused
at its attach; each error names the setting and both values."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from nanokv.config import CacheConfig, ComputeConfig, EngineConfig, GatewayConfig
from nanokv.errors import ConfigError
from nanokv.flags import add_config_args, service_config
from nanokv.launch import start_services

TINY = {"model": "random:tiny-qwen3", "device": "cpu", "dtype": "float32", "block_size": 8, "num_gpu_blocks": 64,
        "max_num_batched_tokens": 256, "max_num_seqs": 8}


def nanokv(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanokv.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)


def flags_of(command: str) -> set[str]:
    out = nanokv(command, "--help", timeout=60)
    assert out.returncode == 0, out.stderr
    return {w.rstrip(",") for w in out.stdout.split() if w.startswith("--")}


# ---- each service's flags are its own --------------------------------------------------------------
def test_each_service_help_lists_only_its_own_flags():
    cache, compute, gateway, up = (flags_of(c) for c in ("cache", "compute", "gateway", "up"))
    assert {"--block-size", "--eviction-policy", "--enable-compression", "--metrics-port"} <= cache
    assert not {"--attention-backend", "--enforce-eager", "--kernel-options", "--model", "--max-num-seqs",
                "--num-gpu-blocks", "--adaptive-mode"} & cache
    assert {"--model", "--attention-backend", "--enforce-eager", "--kernel-options", "--tensor-parallel-size",
            "--block-size", "--num-gpu-blocks", "--metrics-port"} <= compute
    assert not {"--eviction-policy", "--lru-k", "--adaptive-mode", "--enable-chunked-prefill"} & compute
    assert {"--max-num-seqs", "--api-key", "--adaptive-mode", "--enable-chunked-prefill", "--model"} <= gateway
    assert not {"--num-gpu-blocks", "--block-size", "--eviction-policy", "--attention-backend", "--enforce-eager",
                "--kernel-options", "--gpu-memory-utilization", "--metrics-port", "--cache-address"} & gateway
    # `up` runs all three: every flat name of EngineConfig
    assert {"--" + k.replace("_", "-") for k in EngineConfig.keys()} <= up


def parse(config_cls: type, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_args(parser, config_cls)
    return parser.parse_args(list(argv))


def test_a_service_builds_its_own_config_from_its_flags():
    cfg = service_config(parse(CacheConfig, "--block-size", "32", "--eviction-policy", "arc", "--metrics-port", "9101"))
    assert isinstance(cfg, CacheConfig) and (cfg.block_size, cfg.eviction_policy, cfg.metrics_port) == (32, "arc", 9101)
    # --config-json may hold the whole EngineConfig (`nanokv up` passes one to all): each takes its own keys
    whole = '{"num_gpu_blocks": 64, "eviction_policy": "lru", "block_size": 32, "attention_backend": "torch"}'
    cache = service_config(parse(CacheConfig, "--config-json", whole, "--block-size", "64"))
    compute = service_config(parse(ComputeConfig, "--config-json", whole))
    assert (cache.eviction_policy, cache.block_size) == ("lru", 64)  # a flag beside it wins
    assert (compute.num_gpu_blocks, compute.attention_backend, compute.block_size) == (64, "torch", 32)
    with pytest.raises(ConfigError, match="did you mean 'eviction_policy'"):
        service_config(parse(CacheConfig, "--config-json", '{"eviction_polcy": "lru"}'))
    with pytest.raises(ConfigError, match="eviction_policy: got 'random'; allowed values: lru"):
        service_config(parse(CacheConfig, "--eviction-policy", "random"))


def test_bad_flag_of_a_service_exits_2_naming_it():
    out = nanokv("cache", "--listen", "127.0.0.1:1", "--lru-k", "7", timeout=60)
    assert out.returncode == 2 and "lru_k: got 7; must be between 2 and 3" in out.stderr


# ---- EngineConfig: the flat names, composed -----------------------------------------------------------
def test_engine_config_flat_names_reach_each_service():
    cfg = EngineConfig.from_kwargs(num_gpu_blocks=64, eviction_policy="lru", block_size=32, max_num_seqs=4,
                                   attention_backend="torch", adaptive=True)
    assert (cfg.num_gpu_blocks, cfg.eviction_policy, cfg.block_size, cfg.max_num_seqs) == (64, "lru", 32, 4)
    assert cfg.cache.eviction_policy == "lru" and cfg.compute.num_gpu_blocks == 64
    assert cfg.cache.block_size == cfg.compute.block_size == 32  # shared: one flat name sets both
    assert cfg.compute.max_num_seqs == cfg.gateway.max_num_seqs == 4
    assert cfg.cache.adaptive and cfg.compute.adaptive and cfg.gateway.adaptive
    assert isinstance(cfg.gateway, GatewayConfig) and not hasattr(cfg.gateway, "eviction_policy")
    assert EngineConfig(**cfg.to_dict()) == cfg
    assert cfg.replace(block_size=64).cache.block_size == 64 and cfg.block_size == 32
    with pytest.raises(AttributeError, match="frozen"):
        cfg.block_size = 16  # type: ignore[misc]
    with pytest.raises(ConfigError, match="did you mean 'num_gpu_blocks'"):
        EngineConfig.from_kwargs(num_gpu_block=64)


@pytest.mark.parametrize("kwargs,field,allowed", [
    ({"eviction_policy": "random"}, "eviction_policy", "allowed values: lru"),
    ({"attention_backend": "cuda"}, "attention_backend", "allowed values: auto, torch, triton"),
    ({"max_num_seqs": 0}, "max_num_seqs", "between 1 and 65536"),
    ({"block_size": 24}, "block_size", "a power of two from 8 to 256"),
    ({"cache_address": "unix:/x.sock"}, "compute_address", "go together"),
    ({"compression_sparsity": 1.0}, "compression_sparsity", "[0, 1)"),
    ({"sparsity_policy": "lru"}, "sparsity_policy", "allowed values: streaming, interval, attention, hybrid"),
    ({"compression_sparsity": 0.5, "sparsity_options": "window=4"}, "sparsity_options",
     "sink_blocks, recent_blocks, min_ranked, score_mode, store_fraction"),
    ({"compression_sparsity": 0.5, "sparsity_options": "score_mode=mean"}, "sparsity_options", "allowed: max, sum"),
    ({"compression_sparsity": 0.5, "sparsity_options": "recent_blocks=x"}, "sparsity_options", "an integer"),
    ({"compression_sparsity": 0.5, "sparsity_policy": "hybrid"}, "sparsity_policy", "quantization_bitwidth 8"),
])
def test_engine_config_validates_through_the_owning_service(kwargs, field, allowed):
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_kwargs(**kwargs)
    assert e.value.field == field and allowed in str(e.value)


def test_service_configs_validate_alone():
    with pytest.raises(ConfigError, match="metrics_port: got 70000; allowed: a TCP port"):
        ComputeConfig(metrics_port=70000)
    with pytest.raises(ConfigError, match="quantization_bitwidth: got 3; allowed bit widths: 4, 8, 16"):
        CacheConfig(enable_compression=True, quantization_bitwidth=3)
    assert CacheConfig(enable_compression=True, quantization_bitwidth=4).block_size == 32  # auto, as before
    assert ComputeConfig().metrics_port == CacheConfig().metrics_port == 0  # off unless asked


# ---- agreement, with real processes ----------------------------------------------------------------
@pytest.fixture(scope="module")
def services():
    with start_services({**TINY, "eviction_policy": "lru"}) as svc:
        yield svc


def compute_against(cache_address: str, tmp_path, *flags: str) -> subprocess.CompletedProcess:
    argv = ["compute", "--listen", f"unix:{tmp_path}/compute.sock", "--cache", cache_address,
            "--model", TINY["model"], "--device", "cpu", "--dtype", "float32", "--num-gpu-blocks", "64",
            "--max-num-batched-tokens", "256", "--max-num-seqs", "8", *flags]
    return nanokv(*argv)


def test_compute_with_another_block_size_is_refused_at_attach(services, tmp_path):
    out = compute_against(services.cache_address, tmp_path, "--block-size", "32")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "block_size: the cache service has 8, the compute service 32" in out.stderr


def test_compute_with_another_kv_format_is_refused_at_attach(services, tmp_path):
    out = compute_against(services.cache_address, tmp_path, "--block-size", "8", "--enable-compression",
                          "--quantization-bitwidth", '{"default": 8, "layers": {"-1": 16}}')
    assert out.returncode == 2, out.stderr[-2000:]
    assert ("quantization_bitwidth: the cache service has KV bits 16 (layers 0-1), the compute service KV bits "
            "8 (layer 0), 16 (layer 1)") in out.stderr


def test_compute_with_other_sparsity_settings_is_refused_at_attach(services, tmp_path):
    out = compute_against(services.cache_address, tmp_path, "--block-size", "8", "--compression-sparsity", "0.5",
                          "--sparsity-options", "recent_blocks=4")
    assert out.returncode == 2, out.stderr[-2000:]
    assert ("compression_sparsity: the cache service has block sparsity off, the compute service block sparsity "
            "streaming@0.5 (sink_blocks=4, recent_blocks=4, min_ranked=8, score_mode='max', store_fraction=0.5, "
            "probe_window=32)"
            ) in out.stderr


def gateway_against(svc, *flags: str) -> subprocess.CompletedProcess:
    return nanokv("gateway", "--cache", svc.cache_address, "--compute", svc.compute_address, "--port", "0",
                  "--grpc-port", "0", *flags)


def test_gateway_expecting_another_model_is_refused(services):
    out = gateway_against(services, "--model", "random:tiny-llama", "--max-num-batched-tokens", "256",
                          "--max-num-seqs", "8")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "model: the gateway has random:tiny-llama, the compute service random:tiny-qwen3" in out.stderr


def test_gateway_with_a_larger_batch_than_compute_sized_for_is_refused(services):
    out = gateway_against(services, "--max-num-seqs", "16", "--max-num-batched-tokens", "256")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "max_num_seqs: the gateway has 16, the compute service 8" in out.stderr


def test_a_remote_gateway_runs_by_the_cache_services_settings(services):
    """The gateway was told nothing of eviction: it takes the cache service's at attach (Cache.Info),
    and the refused compute services above left the pool as it was."""
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    llm = LLM(TINY["model"], cache_address=services.cache_address, compute_address=services.compute_address,
              max_num_batched_tokens=256, max_num_seqs=8)
    try:
        cfg = llm.engine.config
        assert (cfg.eviction_policy, cfg.block_size, cfg.cache.eviction_policy) == ("lru", 8, "lru")
        out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)[0]
        assert out.error is None and len(out.token_ids) == 4
    finally:
        llm.engine.shutdown()
