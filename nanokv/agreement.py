"""The settings the services must agree on, checked when they meet.

Each service is started with its own config (nanokv.service_config), so nothing but these checks
keeps two of them consistent:

  compute -> cache (Cache.Attach, PoolTerms): block_size and the configured KV format per layer must
      be the cache service's own (its planner counts tokens per block; a plan for 16-token blocks on
      a pool of 32-token blocks would address the wrong slots); so must block sparsity's settings (the
      cache service decides what the compute service measures and copies); the model is recorded
  gateway -> both (nanokv.gateway.recovery, at every attach): the cache service's block size is the
      compute service's; the model is the one the gateway expects (if it names one); the gateway's
      batch limits fit the buffers the compute service sized for them

A mismatch is a Mismatch (FAILED_PRECONDITION over gRPC) naming the setting and both values.
"""

from __future__ import annotations

import os
from typing import Any

from nanokv.errors import ConfigError, PreconditionError
from nanokv.messages import ModelInfo, PoolTerms

EMBEDDED_MODEL = "the embedded SmolLM2-135M-Instruct"


class Mismatch(PreconditionError):
    """Two services were started with different values of a setting they must share."""

    def __init__(self, setting: str, a: tuple[str, Any], b: tuple[str, Any], fix: str = ""):
        super().__init__(setting, f"the {a[0]} has {a[1]}, the {b[0]} {b[1]}" + (f"; {fix}" if fix else ""))


def bits_text(bits: list[int]) -> str:
    """[8, 8, 8, 4] -> '8 (layers 0-2), 4 (layer 3)': runs, so a 30-layer plan stays readable."""
    runs: list[tuple[int, int, int]] = []  # (bits, first layer, last layer)
    for i, b in enumerate(bits):
        if runs and runs[-1][0] == b:
            runs[-1] = (b, runs[-1][1], i)
        else:
            runs.append((b, i, i))
    return ", ".join(f"{b} (layer {lo})" if lo == hi else f"{b} (layers {lo}-{hi})" for b, lo, hi in runs)


def pool_terms(config: Any, num_layers: int, model: str) -> PoolTerms:
    """The compute service's terms from its config (a ComputeConfig; num_layers: its model's)."""
    return PoolTerms(config.block_size, config.layer_bits(num_layers), model, sparsity=sparsity_text(config))


def sparsity_text(config: Any) -> str:
    """Block sparsity's settings of a CacheConfig or ComputeConfig, canonical ("": off)."""
    params = config.sparsity_params
    return params.describe() if params is not None else ""


def check_attach(cache_config: Any, terms: PoolTerms) -> None:
    """The cache service's side of an attach: its config against the compute service's terms."""
    cache, compute = "cache service", "compute service"
    if terms.block_size != cache_config.block_size:
        raise Mismatch("block_size", (cache, cache_config.block_size), (compute, terms.block_size),
                       "start both with the same --block-size")
    try:
        mine = cache_config.layer_bits(len(terms.layer_bits))
    except ConfigError as e:  # a per-layer plan for layers this model does not have
        raise Mismatch("quantization_bitwidth", (cache, f"a plan it cannot apply ({e})"),
                       (compute, bits_text(terms.layer_bits))) from None
    if mine != list(terms.layer_bits):
        raise Mismatch("quantization_bitwidth", (cache, f"KV bits {bits_text(mine)}"),
                       (compute, f"KV bits {bits_text(list(terms.layer_bits))}"),
                       "start both with the same --enable-compression and --quantization-bitwidth")
    mine_s = sparsity_text(cache_config)
    if mine_s != terms.sparsity:
        raise Mismatch("compression_sparsity", (cache, f"block sparsity {mine_s or 'off'}"),
                       (compute, f"block sparsity {terms.sparsity or 'off'}"),
                       "start both with the same --compression-sparsity, --sparsity-policy and --sparsity-options")


def _same_model(a: str, b: str) -> bool:
    return a == b or os.path.normpath(a) == os.path.normpath(b)


def check_gateway(gateway_config: Any, cache_config: Any, info: ModelInfo) -> None:
    """The gateway's side of an attach: the cache service's config, the compute service's answer to
    Info, and the gateway's own config (a GatewayConfig) agree."""
    if cache_config.block_size != info.block_size:
        raise Mismatch("block_size", ("cache service", cache_config.block_size),
                       ("compute service", info.block_size))
    want = gateway_config.model
    if want is not None and not _same_model(want, info.model or ""):
        raise Mismatch("model", ("gateway", want), ("compute service", info.model or EMBEDDED_MODEL),
                       "start the gateway with the compute service's --model, or without --model")
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        theirs = getattr(info, name)
        if theirs and getattr(gateway_config, name) > theirs:
            raise Mismatch(name, ("gateway", getattr(gateway_config, name)), ("compute service", theirs),
                           "the gateway's may not exceed the compute service's (it sized its buffers for it)")
