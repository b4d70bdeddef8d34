"""Simulated ("fake") KV quantization, for choosing a format by measurement only.

A FakeQuant on a 16-bit layer (SimulatedKV) replaces K/V by dequant(quant(K/V)) under some
candidate granularity just before they are stored, so the eval can score formats the kernels do
not implement (per-channel keys, smaller groups, rotated values, full-precision sinks) through the
very same paged path. The math of the token-wise modes mirrors nanokv.kv.quant exactly (fp16 scale
and zero, same rounding), so FakeQuant(bits=4) scores the same as the real int4 cache; a test
checks that. Never used in serving.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from nanokv.kv.cache import FullKV
from nanokv.kv.rotation import rotation_matrix


def _safe(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.ones_like(scale), scale)  # as nanokv.kv.quant._safe_scale


def fq_lastdim(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize-dequantize x along its last dim like nanokv.kv.quant: int8 symmetric, int4 (and, for
    simulation only, int3/int2) asymmetric with float16 scale and zero."""
    xf = x.float()
    if bits == 8:
        scale = _safe((xf.abs().amax(dim=-1, keepdim=True) / 127.0).half().float())
        return torch.round(xf / scale).clamp_(-127, 127) * scale
    if bits in (2, 3, 4):
        top = float(2**bits - 1)
        lo, hi = xf.amin(dim=-1, keepdim=True), xf.amax(dim=-1, keepdim=True)
        scale = _safe(((hi - lo) / top).half().float())
        zero = lo.half().float()
        return torch.round((xf - zero) / scale).clamp_(0, top) * scale + zero
    raise ValueError(f"fake quantization supports 8, 4, 3 and 2 bits, got {bits}")


def fq_groups(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """x [..., D] -> fake-quantized per group of `group` consecutive dims (0 = the whole row)."""
    D = x.shape[-1]
    if group in (0, D):
        return fq_lastdim(x, bits)
    if D % group:
        raise ValueError(f"group {group} does not divide head_dim {D}")
    return fq_lastdim(x.reshape(*x.shape[:-1], D // group, group), bits).reshape(x.shape)


@dataclass
class FakeQuant:
    k_bits: int = 4
    v_bits: int = 4
    group: int = 0  # token-wise group along head_dim (0 = head_dim)
    k_per_channel: bool = False  # keys: one scale/zero per (page, head, channel) over the page's tokens
    rotate_v: bool = False  # values quantized in the rotated basis (exact: the output is rotated back)
    sink_tokens: int = 0  # positions below this stay full precision (attention sinks)
    # quantize-on-fill: K/V are stored in full precision and a block is quantized (K per channel over
    # its tokens if k_per_channel, V per token) only once its last slot is written, after that step's
    # attention: the open block and the step's own tokens are read in full precision (see on_fill)
    on_fill: bool = False

    def apply(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              seq_index: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [T, H, D]; positions, seq_index [T] (token position, sequence in the step) -> k~, v~."""
        if self.on_fill:
            return k, v  # quantized later, block by block (fill_blocks)
        dtype = k.dtype
        kq = self._keys(k.float(), positions, seq_index, block_size)
        vf = v.float()
        if self.rotate_v:
            r = rotation_matrix(v.shape[-1], torch.float32, v.device)
            vq = fq_groups(vf @ r, self.v_bits, self.group) @ r.T
        else:
            vq = fq_groups(vf, self.v_bits, self.group)
        if self.sink_tokens > 0:
            sink = (positions < self.sink_tokens)[:, None, None]  # [T, 1, 1]
            kq = torch.where(sink, k.float(), kq)
            vq = torch.where(sink, vf, vq)
        return kq.to(dtype), vq.to(dtype)

    def _keys(self, k: torch.Tensor, positions: torch.Tensor, seq_index: torch.Tensor,
              block_size: int) -> torch.Tensor:
        if not self.k_per_channel:
            return fq_groups(k, self.k_bits, self.group)
        # KIVI on pages: tokens of one (sequence, page) share a scale per channel. The eval feeds
        # block-aligned chunks, so each page is complete within one step (a real cache would keep
        # the open tail page in full precision until it fills, which is only better).
        out = torch.empty_like(k)
        page = seq_index.long() * (1 << 40) + torch.div(positions.long(), block_size, rounding_mode="floor")
        for g in torch.unique(page):
            rows = (page == g).nonzero().squeeze(1)
            grp = k[rows].permute(1, 2, 0)  # [H, D, n]: quantize along the page's tokens
            out[rows] = fq_lastdim(grp, self.k_bits).permute(2, 0, 1)
        return out

    def fill_blocks(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    positions: torch.Tensor) -> None:
        """on_fill mode, after the step's attention: quantize in place every block whose last slot this
        step wrote. k_cache, v_cache [N, H, bs, D] (16-bit sim cache); slot_mapping, positions [T]."""
        bs = k_cache.shape[2]
        last = (slot_mapping >= 0) & (slot_mapping % bs == bs - 1)
        last &= positions - (bs - 1) >= self.sink_tokens  # sink blocks stay full precision
        blocks = (slot_mapping[last] // bs).long()
        if blocks.numel() == 0:
            return
        kb, vb = k_cache[blocks].float(), v_cache[blocks].float()  # [n, H, bs, D]
        if self.k_per_channel:
            kq = fq_lastdim(kb.transpose(2, 3), self.k_bits).transpose(2, 3)  # group = the block's tokens
        else:
            kq = fq_groups(kb, self.k_bits, self.group)
        if self.rotate_v:
            r = rotation_matrix(vb.shape[-1], torch.float32, vb.device)
            vq = fq_groups(vb @ r, self.v_bits, self.group) @ r.T
        else:
            vq = fq_groups(vb, self.v_bits, self.group)
        k_cache[blocks] = kq.to(k_cache.dtype)
        v_cache[blocks] = vq.to(v_cache.dtype)

    def bits_per_value(self, head_dim: int, block_size: int) -> float:
        """Average stored bits per K/V element, fp16 scales/zeros included (sinks not counted)."""
        def token_bits(bits: int) -> float:
            g = self.group or head_dim
            return bits + (16 if bits == 8 else 32) / g
        k = (self.k_bits + (16 if self.k_bits == 8 else 32) / block_size) if self.k_per_channel \
            else token_bits(self.k_bits)
        return (k + token_bits(self.v_bits)) / 2


@dataclass(frozen=True, eq=False)
class SimulatedKV(FullKV):
    """A 16-bit layer that stores dequant(quant(K/V)) under `fake_quant` (the store hook applies it,
    nanokv.compute_service.kv_hooks). Measurement only: the eval harness makes its layers these."""

    fake_quant: FakeQuant

    @classmethod
    def of(cls, cache: FullKV, fake_quant: FakeQuant) -> SimulatedKV:
        return cls(**{f.name: getattr(cache, f.name) for f in fields(FullKV)}, fake_quant=fake_quant)
