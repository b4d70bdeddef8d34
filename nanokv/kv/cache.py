"""Paged KV cache tensors for one layer, in one of three formats: one frozen type per format.

Layout (the contract every kernel and the torch reference share). N blocks, H kv heads on this
rank, bs = block_size, D = head_dim. A block id means the same thing in every layer and format.

  FullKV  (bits=16)  k, v: [N, H, bs, D] model dtype
  Int8KV  (bits=8)   k, v: int8  [N, H, bs, D]      k_scale, v_scale: float16 [N, H, bs]  (symmetric, per token-head)
           v is a transposed view: its memory is [N, H, D, bs] (block_tensor, v_transposed)
  Int4KV  (bits=4)   k, v: uint8 [N, H, bs, D // 2] (dim d in the low nibble, d + D/2 in the high nibble)
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

Every field of a format is present (no None): code dispatches on the type (isinstance), which also
tells a type checker which tensors exist. The types are frozen: a resize or re-format makes a new
object (dataclasses.replace), and the runner replaces its list's entry. What a layer carries at run
time besides its tensors (compression monitor, error probe, value rotation folded into the weights)
is the compute service's, per layer, and outlives these objects
(nanokv.compute_service.kv_hooks.LayerHooks). Two variants extend a format for one feature each:
nanokv.kv.fakequant.SimulatedKV (a FullKV simulating another format, measurement only) and
nanokv.kv.demote.HybridInt8KV (an Int8KV whose table entries <= -2 read an INT4 demotion store).

Two flags of every format say in which basis K and V are stored:
  rotate    keys are stored multiplied by the orthonormal R of nanokv.kv.rotation (queries are
            rotated the same way before attention), so kernels need not know: scores are unchanged;
  rotate_v  values are stored as v R (int4; a simulation may ask it of a 16-bit layer): the attention
            output is rotated back (o R^T, nanokv.compute_service.kv_hooks.after_attention), exact in
            real arithmetic; the rotation spreads a value row's outlier channels so its per-row int4
            range fits the rest better.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import ClassVar, TypeAlias

import torch

from nanokv.kv.rotation import rotates
from nanokv.kv.staging import StageTable

# alloc(shape, dtype) -> a zero-filled tensor: where a cache's tensors come from (default: new ones
# on the device; nanokv.cache_service.storage carves them from one shared segment instead)
Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def zeros_on(device: torch.device | str) -> Alloc:
    return lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device)


@dataclass(frozen=True, eq=False)
class _PagedKV:
    """What every format has: codes (or values) k, v with leading dims [N, H, bs], and its basis."""

    bits: ClassVar[int]
    # the tensors indexed by block id (leading dimension N): what a resize reallocates
    block_fields: ClassVar[tuple[str, ...]] = ("k", "v")

    k: torch.Tensor
    v: torch.Tensor
    rotate: bool = field(default=False, kw_only=True)  # keys (and queries) stored rotated by R
    rotate_v: bool = field(default=False, kw_only=True)  # values stored as v R, the output rotated back

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
    def head_dim(self) -> int:
        return int(self.k.shape[3])

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the format by field name (codes, scales, zero points, staging)."""
        return {f.name: x for f in fields(self) if isinstance(x := getattr(self, f.name), torch.Tensor)}


@dataclass(frozen=True, eq=False)
class FullKV(_PagedKV):
    """bits=16: k, v [N, H, bs, D] in the model's dtype."""

    bits: ClassVar[int] = 16


@dataclass(frozen=True, eq=False)
class Int8KV(_PagedKV):
    """bits=8: int8 codes, symmetric float16 scales per (token, head); v dims-major in memory."""

    bits: ClassVar[int] = 8
    block_fields: ClassVar[tuple[str, ...]] = ("k", "v", "k_scale", "v_scale")

    k_scale: torch.Tensor  # [N, H, bs] float16
    v_scale: torch.Tensor


@dataclass(frozen=True, eq=False)
class Int4KV(_PagedKV):
    """bits=4: packed uint8 codes (keys per channel over a block, values per token) and the
    full-precision staging of open blocks; v dims-major in memory."""

    bits: ClassVar[int] = 4
    block_fields: ClassVar[tuple[str, ...]] = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")

    k_scale: torch.Tensor  # [N, H, D] float16
    k_zero: torch.Tensor
    v_scale: torch.Tensor  # [N, H, bs] float16
    v_zero: torch.Tensor
    k_stage: torch.Tensor  # [S, H, bs, D] model dtype: open blocks in full precision
    v_stage: torch.Tensor
    stage: StageTable  # block -> staging slot (one table shared by all layers of a runner)

    @property
    def head_dim(self) -> int:
        return 2 * int(self.k.shape[3])  # packed: two values per byte


# one layer's KV: the type says which tensors exist (isinstance narrows it)
LayerKV: TypeAlias = FullKV | Int8KV | Int4KV


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
) -> LayerKV:
    """A zeroed layer of format `bits`. `rotate`: None = the default for this bit width
    (nanokv.kv.rotation.DEFAULT_ROTATE_BITS); int4 stores values rotated (rotate_v).
    `stage`: int4 only, the runner's staging table (one for all layers); None = a private one with a
    slot per block (tests and tools that drive a lone cache). `alloc`: where the tensors come from
    (default: new zero tensors on `device`). The tensors are allocated in a fixed order (the
    segment's layout, nanokv.kv.segment): k, v, then the format's scales and zero points, then staging."""
    alloc = alloc or zeros_on(device)
    rot = rotates(bits, rotate)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    meta = (num_blocks, num_kv_heads, block_size)
    if bits == 16:
        return FullKV(alloc(shape, dtype), alloc(shape, dtype), rotate=rot)
    if bits == 8:
        k = alloc(shape, torch.int8)
        v = block_tensor(shape, torch.int8, "meta", transposed=v_transposed(8), alloc=alloc)
        return Int8KV(k, v, k_scale=alloc(meta, torch.float16), v_scale=alloc(meta, torch.float16), rotate=rot)
    if bits == 4:
        if head_dim % 2:
            raise ValueError("int4 KV needs an even head_dim")
        half = (num_blocks, num_kv_heads, block_size, head_dim // 2)
        chan = (num_blocks, num_kv_heads, head_dim)
        k = alloc(half, torch.uint8)
        v = block_tensor(half, torch.uint8, "meta", transposed=v_transposed(4), alloc=alloc)
        k_scale, v_scale = alloc(chan, torch.float16), alloc(meta, torch.float16)
        k_zero, v_zero = alloc(chan, torch.float16), alloc(meta, torch.float16)
        table = stage if stage is not None else StageTable(num_blocks, num_blocks, block_size, device)
        sshape = (table.num_slots, num_kv_heads, block_size, head_dim)
        k_stage = alloc(sshape, dtype)
        v_stage = alloc(sshape, dtype)
        return Int4KV(k, v, k_scale=k_scale, k_zero=k_zero, v_scale=v_scale, v_zero=v_zero, k_stage=k_stage,
                      v_stage=v_stage, stage=table, rotate=rot, rotate_v=True)
    raise ValueError(f"unsupported KV bit width {bits}")


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


def check_layout(cache: LayerKV) -> None:
    """For kernels that address codes by strides they assume: int8 values dims-major, all else
    row-major, K and V sharing block and head strides. A tensor swapped in by hand (a plain
    torch.zeros) would otherwise be read as the wrong layout."""
    k, v = cache.k, cache.v
    if (is_transposed(v) != v_transposed(cache.bits) or k.stride(3) != 1
            or k.stride()[:2] != v.stride()[:2]):  # kernels address V's blocks and heads with K's strides
        raise RuntimeError(f"KV layout of a {cache.bits}-bit cache: k strides {cache.k.stride()}, v strides "
                           f"{cache.v.stride()}; allocate with kv.cache (block_tensor keeps int8 values "
                           "dims-major)")
