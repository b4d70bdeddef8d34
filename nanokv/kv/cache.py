"""Paged KV cache tensors for one layer, in one of three formats.

Layout (the contract every kernel and the torch reference share). N blocks, H kv heads on this
rank, bs = block_size, D = head_dim. A block id means the same thing in every layer and format.

  bits=16  k, v: [N, H, bs, D] model dtype
  bits=8   k, v: int8  [N, H, bs, D]      k_scale, v_scale: float16 [N, H, bs]  (symmetric, per token-head)
           v is a transposed view: its memory is [N, H, D, bs] (block_tensor, v_transposed)
  bits=4   k, v: uint8 [N, H, bs, D // 2] (dim d in the low nibble, d + D/2 in the high nibble)
           v is a transposed view, as int8's: its memory is [N, H, D // 2, bs]
           k_scale, k_zero: float16 [N, H, D]   keys per channel over the block's tokens (KIVI)
           v_scale, v_zero: float16 [N, H, bs]  values per token-head, stored rotated (v R)
           k_stage, v_stage: [S, H, bs, D] model dtype: full-precision staging of open blocks, shared
           block -> slot map `stage` (nanokv.kv.staging): a block is quantized once, when it fills

[H, bs, D] per block keeps one (block, head) tile contiguous, so a decode program reads bs*D
consecutive elements per block. int8 and int4 values keep the tile contiguous too but dims-major
([D, bs], int4 [D/2, bs] bytes): the decode's value product reads V^T tiles (tokens along the
tensor-core operand's inner dimension), and with tokens contiguous in memory the compiler loads the
code operand straight into registers (one 16-byte copy per row) instead of a byte-wise transposing
gather (nanokv.kernels.triton_decode_swap, triton_decode_swap4).
Indexing `v` logically ([N, H, bs, D]) works unchanged; only kernels see the strides.

int4 values are stored rotated by the same orthonormal R (v R): the attention output is rotated back
(o R^T, nanokv.compute_service.kv_hooks.after_attention), exact in real arithmetic; the rotation spreads a value
row's outlier channels so its per-row int4 range fits the rest better.

Layers with `rotate` set store keys multiplied by the orthonormal R of nanokv.kv.rotation (queries
are rotated the same way before attention), so kernels need not know: scores are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nanokv.kv.rotation import rotates
from nanokv.kv.staging import StageTable

if TYPE_CHECKING:
    from nanokv.kv.demote import DemotedBlocks

# alloc(shape, dtype) -> a zero-filled tensor: where a cache's tensors come from (default: new ones
# on the device; nanokv.cache_service.storage carves them from one shared segment instead)
Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def zeros_on(device: torch.device | str) -> Alloc:
    return lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device)


@dataclass
class LayerKVCache:
    bits: int
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None
    k_stage: torch.Tensor | None = None  # int4: [S, H, bs, D] open blocks in full precision
    v_stage: torch.Tensor | None = None
    stage: StageTable | None = None  # int4: block -> staging slot (one table shared by all layers)
    # host-side, not tensor layout: read by nanokv.compute_service.kv_hooks.before_store (the model's attention layer)
    rotate_v: bool = False  # int4: values stored rotated, attention output rotated back
    # the model's weights already make v R and take o R (ModelRunner.fold_value_rotations): the
    # hooks skip both GEMMs, and stored values are in that basis whatever the layer's format
    rotate_v_in_weights: bool = False
    rotate: bool = False  # keys (and queries) are Hadamard-rotated before store: part of the format
    monitor: Any = None  # nanokv.kv.monitor.CompressionMonitor sampling this layer's store error
    fake_quant: Any = None  # measurement only (nanokv.kv.fakequant): simulate a format on a 16-bit cache
    # hybrid sparsity, int8 layers: this layer's INT4 demotion store, read for table entries <= -2 (kv.demote)
    demoted: DemotedBlocks | None = None
    probe: Any = None  # nanokv.compute_service.error_probe.ErrorProbe: called with (layer, q, k, v) on each store
    # int4: the step's decode kernel already quantized the blocks this step filled (the CUDA decode,
    # nanokv.kernels.cuda_decode_int4); read and cleared by nanokv.compute_service.kv_hooks.after_attention
    filled_in_step: bool = False

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.k.shape[1])

    @property
    def block_size(self) -> int:
        return int(self.k.shape[2])

    @property
    def quantized(self) -> bool:
        return self.bits < 16


def bytes_per_block(bits: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block of K and V takes in one layer, scales and zero points included."""
    n = num_kv_heads * block_size
    if bits == 16:
        return 2 * n * head_dim * torch.empty((), dtype=dtype).element_size()
    if bits == 8:
        return 2 * (n * head_dim + 2 * n)
    if bits == 4:  # codes, K scale/zero per (head, channel), V scale/zero per (token, head)
        return 2 * n * head_dim // 2 + 4 * num_kv_heads * head_dim + 4 * n
    raise ValueError(f"unsupported KV bit width {bits}")


def allocate_layer_cache(
    bits: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
    dtype: torch.dtype, device: torch.device | str, rotate: bool | None = None,
    stage: StageTable | None = None, alloc: Alloc | None = None,
) -> LayerKVCache:
    """`rotate`: None = the default for this bit width (nanokv.kv.rotation.DEFAULT_ROTATE_BITS).
    `stage`: int4 only, the runner's staging table (one for all layers); None = a private one with a
    slot per block (tests and tools that drive a lone cache). `alloc`: where the tensors come from
    (default: new zero tensors on `device`)."""
    alloc = alloc or zeros_on(device)
    cache = _allocate(bits, num_blocks, num_kv_heads, block_size, head_dim, dtype, alloc)
    cache.rotate = rotates(bits, rotate)
    if bits == 4:
        cache.stage = stage or StageTable(num_blocks, num_blocks, block_size, device)
        sshape = (cache.stage.num_slots, num_kv_heads, block_size, head_dim)
        cache.k_stage = alloc(sshape, dtype)
        cache.v_stage = alloc(sshape, dtype)
        cache.rotate_v = True
    return cache


def v_transposed(bits: int) -> bool:
    """Whether this format stores its value codes dims-major per block (int8, int4)."""
    return bits in (8, 4)


def block_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                 transposed: bool = False, alloc: Alloc | None = None) -> torch.Tensor:
    """Zeros of logical shape [N, H, bs, D]; transposed: memory [N, H, D, bs], returned as its view."""
    alloc = alloc or zeros_on(device)
    if not transposed:
        return alloc(shape, dtype)
    n, h, bs, d = shape
    return alloc((n, h, d, bs), dtype).transpose(2, 3)


def is_transposed(x: torch.Tensor) -> bool:
    """A block tensor made by block_tensor(..., transposed=True) (or a copy keeping its strides)."""
    return x.dim() == 4 and x.stride(2) == 1 and x.stride(3) == x.shape[2]  # memory [.., D, bs]: tokens contiguous


def check_layout(cache: LayerKVCache) -> None:
    """For kernels that address codes by strides they assume: int8 values dims-major, all else
    row-major, K and V sharing block and head strides. A tensor swapped in by hand (a plain
    torch.zeros) would otherwise be read as the wrong layout."""
    k, v = cache.k, cache.v
    if (is_transposed(v) != v_transposed(cache.bits) or k.stride(3) != 1
            or k.stride()[:2] != v.stride()[:2]):  # kernels address V's blocks and heads with K's strides
        raise RuntimeError(f"KV layout of a {cache.bits}-bit cache: k strides {cache.k.stride()}, v strides "
                           f"{cache.v.stride()}; allocate with kv.cache (block_tensor keeps int8 values "
                           "dims-major)")


def _allocate(
    bits: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
    dtype: torch.dtype, alloc: Alloc,
) -> LayerKVCache:
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    meta = (num_blocks, num_kv_heads, block_size)
    if bits == 16:
        return LayerKVCache(16, alloc(shape, dtype), alloc(shape, dtype))
    if bits == 8:
        return LayerKVCache(
            8, alloc(shape, torch.int8),
            block_tensor(shape, torch.int8, "meta", transposed=v_transposed(8), alloc=alloc),
            k_scale=alloc(meta, torch.float16),
            v_scale=alloc(meta, torch.float16),
        )
    if bits == 4:
        if head_dim % 2:
            raise ValueError("int4 KV needs an even head_dim")
        half = (num_blocks, num_kv_heads, block_size, head_dim // 2)
        chan = (num_blocks, num_kv_heads, head_dim)
        return LayerKVCache(
            4, alloc(half, torch.uint8),
            block_tensor(half, torch.uint8, "meta", transposed=v_transposed(4), alloc=alloc),
            k_scale=alloc(chan, torch.float16),
            v_scale=alloc(meta, torch.float16),
            k_zero=alloc(chan, torch.float16),
            v_zero=alloc(meta, torch.float16),
        )
    raise ValueError(f"unsupported KV bit width {bits}")
