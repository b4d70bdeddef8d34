"""Hybrid sparsity's INT4 demotion store: a demoted INT8 block leaves the block pool.

Demoting block b of a sequence (the services: nanokv.cache_service.sparsity.decide decides and
keeps the free list, nanokv.compute_service.sparsity.compute_hook copies; nanokv_tools.eval.sparse):
  1. take a free slot j of the store (none free: the block stays INT8, the caller counts it);
  2. give b back to the pool: its block-table entry becomes the code -2 - j
     (KVCacheManager.replace_with_external); -1 stays a hole, >= 0 a pool block;
  3. copy b, re-quantized INT8 -> INT4, into slot j of every layer (`DemotionStore.demote`) before
     anything writes b again (the services: first thing in the next step, before its forward pass).
So the bytes a sequence holds for a demoted block really are INT4-sized, and the INT8 block serves
other sequences. The slot comes back when the sequence drops the entry, finishes, is aborted or is
preempted (the manager calls `release_code`, see KVCacheManager.set_external_release).

Layout, per layer (HybridInt8KV.demoted), M slots in nanokv.kv.quant's per-row int4 format:
    k, v                               uint8   [M, H, bs, D/2]  dim d low nibble, d + D/2 high nibble
    k_scale, k_zero, v_scale, v_zero   float16 [M, H, bs]       one asymmetric range per (token, head) row
A slot number means the same in every layer: one pure-Python free list serves all layers (the
store's own, for the eval harness; between the services, the cache service's DemotionSlots). The codes
come from the dequantized int8 row (a second rounding on top of the int8 one; keys stay in the
rotated basis of the int8 layer).

Bytes per slot and layer: 2 * H * bs * (D/2 + 4) (`slot_bytes`), against 2 * H * bs * (D + 2) for an
int8 block (0.55 of it at D = 64). That is not bytes_per_block(4): the int4 pool format quantizes
keys per channel over a whole block (KIVI); a demoted block keeps the int8 layer's per-row ranges.

Hybrid needs every KV layer in int8 (a block id is shared by all layers, so a block can only leave
the pool when every layer has somewhere to put it). Two readers: the torch reference
(nanokv.kernels.reference.gather_kv; eager steps only) and the Triton decode and prefill kernels
(nanokv.kernels.triton_hybrid), which take the mixed table in one launch and run inside CUDA graphs:
the store's tensors are allocated once, at attach, and never reallocated (a pool resize keeps them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

from nanokv.errors import ConfigError, NanoKVError
from nanokv.kv import quant
from nanokv.kv.cache import Int8KV, LayerKV
from nanokv.sparsity import code_slot, slot_code

code = slot_code  # the block-table entry of store slot j: -2 - j
slot_of = code_slot  # the store slot of a block-table entry <= -2


def slot_bytes(num_kv_heads: int, block_size: int, head_dim: int) -> int:
    """Bytes one slot takes in one layer: K and V codes (D/2 bytes a row), fp16 scale and zero a row."""
    return 2 * num_kv_heads * block_size * (head_dim // 2 + 4)


@dataclass(eq=False)
class DemotedBlocks:
    """One int8 layer's part of the store (shapes in the module docstring)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor

    @classmethod
    def zeros(cls, slots: int, cache: Int8KV) -> DemotedBlocks:
        _, H, bs, D = cache.k.shape
        dev = cache.k.device
        codes = [torch.zeros(slots, H, bs, D // 2, dtype=torch.uint8, device=dev) for _ in range(2)]
        meta = [torch.zeros(slots, H, bs, dtype=torch.float16, device=dev) for _ in range(4)]
        return cls(*codes, *meta)

    def write(self, cache: Int8KV, block_ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Int8 blocks `block_ids` [n] of `cache`, re-quantized to int4, into `slots` [n]."""
        for src, src_scale, dst, dst_scale, dst_zero in (
                (cache.k, cache.k_scale, self.k, self.k_scale, self.k_zero),
                (cache.v, cache.v_scale, self.v, self.v_scale, self.v_zero)):
            x = quant.dequantize_int8(src[block_ids], src_scale[block_ids], torch.float32)  # [n, H, bs, D]
            packed, s4, z4 = quant.quantize_int4(x)  # [n, H, bs, D/2] uint8, [n, H, bs] fp16 x2
            dst[slots], dst_scale[slots], dst_zero[slots] = packed, s4, z4

    def overwrite(self, entries: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """entries [..., nb]: block-table entries; k, v [..., nb, H, bs, D] as read from the int8
        cache (a demoted entry read block 0 there). Demoted entries (<= -2) get their slot's values."""
        sel = entries <= -2  # [..., nb]
        if not bool(sel.any()):
            return
        j = (-2 - entries[sel]).long()  # [n] slots
        k[sel] = quant.dequantize_int4(self.k[j], self.k_scale[j], self.k_zero[j], k.dtype)
        v[sel] = quant.dequantize_int4(self.v[j], self.v_scale[j], self.v_zero[j], v.dtype)


@dataclass(frozen=True, eq=False)
class HybridInt8KV(Int8KV):
    """An int8 layer under hybrid sparsity: block-table entries <= -2 are slots of `demoted`, this
    layer's part of the demotion store, read instead of the pool (nanokv.kernels.reference.gather_kv)."""

    demoted: DemotedBlocks

    @classmethod
    def of(cls, cache: Int8KV, demoted: DemotedBlocks) -> HybridInt8KV:
        return cls(**{f.name: getattr(cache, f.name) for f in fields(Int8KV)}, demoted=demoted)


def _write_torch(cache: HybridInt8KV, block_ids: torch.Tensor, slots: torch.Tensor) -> None:
    cache.demoted.write(cache, block_ids, slots)


class DemotionStore:
    """M slots in every layer of one runner, and their free list (pure Python)."""

    def __init__(self, caches: list[LayerKV], num_slots: int) -> None:
        """caches: the runner's list of layers, every one int8: each becomes a HybridInt8KV in place
        (the forward reads that list), and the store keeps the list, so it sees the layers a resize
        replaces (dataclasses.replace keeps their demotion part)."""
        int8 = [c for c in caches if isinstance(c, Int8KV)]
        if not caches or len(int8) != len(caches):
            raise ConfigError("sparsity_policy", "hybrid demotes INT8 blocks to INT4 and needs every KV layer "
                                                 f"at 8 bits (enable_compression, quantization_bitwidth 8); got "
                                                 f"{[c.bits for c in caches]}")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ConfigError("store_fraction", f"the demotion store needs >= 1 slot, got {num_slots!r}")
        self.caches = caches
        self.num_slots = num_slots
        for i, c in enumerate(int8):
            caches[i] = HybridInt8KV.of(c, DemotedBlocks.zeros(num_slots, c))
        # one layer's copy: DemotedBlocks.write (torch), or one Triton launch on the GPU
        # (nanokv.kernels.triton_demote.demote_blocks, set by the compute service): the same bytes
        self.write_layer: Callable[[HybridInt8KV, torch.Tensor, torch.Tensor], None] = _write_torch
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() hands out 0, 1, 2, ... first
        self._held = [False] * num_slots

    def layers(self) -> list[HybridInt8KV]:
        """The runner's layers now, each with its part of the store."""
        out = [c for c in self.caches if isinstance(c, HybridInt8KV)]
        if len(out) != len(self.caches):
            raise RuntimeError("a layer lost its demotion store (re-formatted or re-attached under hybrid sparsity)")
        return out

    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot takes over all layers, from the tensors themselves."""
        total = 0
        for c in self.layers():
            for t in vars(c.demoted).values():
                total += t[0].numel() * t.element_size()
        return total

    def take(self, n: int) -> list[int]:
        """Up to n free slots (fewer when the store runs out)."""
        out = [self._free.pop() for _ in range(min(n, len(self._free)))]
        for j in out:
            self._held[j] = True
        return out

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or not self._held[slot]:
            raise NanoKVError("slot", f"demotion-store slot {slot} is not held (released twice?)")
        self._held[slot] = False
        self._free.append(slot)

    def release_code(self, entry: int) -> None:
        """Release the slot of a block-table entry (<= -2): the KVCacheManager's external release."""
        self.release(slot_of(entry))

    @torch.no_grad()
    def demote(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Copy these int8 pool blocks, re-quantized to int4, into these held slots, in every layer.
        The caller then gives the blocks back (their table entries become code(slot))."""
        if len(block_ids) != len(slots):
            raise ValueError(f"{len(block_ids)} blocks for {len(slots)} slots")
        if not block_ids:
            return
        dev = self.caches[0].k.device
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=dev)
        js = torch.tensor(list(slots), dtype=torch.long, device=dev)
        for c in self.layers():
            self.write_layer(c, ids, js)
