"""What one KV block costs in each tier's storage format, without torch.

A lower tier may keep blocks narrower than the device pool (int8 or int4 in host memory or on disk
while L1 is bf16): the hierarchy's capacities are byte budgets, so a narrower format holds more
blocks. The byte count is ``nanokv.kv.cache.bytes_per_block``'s layout (tests/cache_service/test_cache_tiers.py
checks the two agree), re-derived here so that the cache service and the simulator need no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanokv.errors import NanoKVError

# format name -> bits per K/V element; 16-bit formats store the model dtype as it is
FORMAT_BITS: dict[str, int] = {"bf16": 16, "fp16": 16, "int8": 8, "int4": 4}


@dataclass(frozen=True)
class KVShape:
    """The KV geometry of a model: what the byte count of a block depends on."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per block
    dtype_bytes: int = 2  # the model dtype's element size (bf16/fp16: 2)


def smollm2_135m(block_size: int) -> KVShape:
    """The embedded model (SmolLM2-135M-Instruct): 30 layers, 3 KV heads of 64 dims."""
    return KVShape(num_layers=30, num_kv_heads=3, head_dim=64, block_size=block_size)


def layer_block_bytes(bits: int, num_kv_heads: int, block_size: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes of one block of K and V in one layer, scales and zero points included (int8: a 2-byte
    scale per (token, head) for K and V; int4: 4-bit codes, K scale/zero per (head, channel), V
    scale/zero per (token, head))."""
    n = num_kv_heads * block_size
    if bits == 16:
        return 2 * n * head_dim * dtype_bytes
    if bits == 8:
        return 2 * (n * head_dim + 2 * n)
    if bits == 4:
        return 2 * n * head_dim // 2 + 4 * num_kv_heads * head_dim + 4 * n
    raise NanoKVError("format", f"unsupported KV bit width {bits}; allowed: 16, 8, 4")


@dataclass(frozen=True)
class TierFormat:
    """A tier's storage format: its name, bits per element and bytes per block (all layers)."""

    name: str
    bits: int
    bytes_per_block: int


def tier_format(name: str, shape: KVShape) -> TierFormat:
    if name not in FORMAT_BITS:
        raise NanoKVError("format", f"got {name!r}; allowed values: {', '.join(FORMAT_BITS)}")
    bits = FORMAT_BITS[name]
    per_layer = layer_block_bytes(bits, shape.num_kv_heads, shape.block_size, shape.head_dim, shape.dtype_bytes)
    return TierFormat(name, bits, shape.num_layers * per_layer)


def blocks_for_bytes(budget_bytes: int, fmt: TierFormat) -> int:
    """How many blocks of ``fmt`` a byte budget holds (0 when it holds none)."""
    return max(0, budget_bytes // fmt.bytes_per_block)
