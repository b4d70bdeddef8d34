"""GGUF 4-bit weights kept packed on the CPU (EngineConfig.weight_quantization="gguf", docs/cpu-decode.md).

A decode step of a small model on the CPU is bound by reading its weights: SmolLM2-135M's matrices
in fp32 are ~540 MB a token, its Q4_1 blocks ~75 MB. GGUF's Q4_0 and Q4_1 store each row in groups
of 32 weights as w = d*q + m (q in 0..15; Q4_0: m = -8d), which is exactly torch's CPU int4 group
format w = (q - 8)*scale + zero with scale = d, zero = m + 8d: the same numbers, with d and m rounded
to bf16 (`aten._weight_int4pack_mm_for_cpu` computes in bf16 activations; its fp32 path is a
scalar fallback some 50x slower). Q8_0 (the tied embedding / LM head: groups of 32 int8 q with
w = d*q) is split into two nibbles, q + 128 = 16 hi + lo, each an int4 group along a doubled `in`:
w = (hi - 8)*16d + (lo - 8)*d + 8d, and the input is fed twice ([x | x], 2*in wide).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

GROUP = 32  # weights per GGUF block along `in` (Q4_0, Q4_1, Q8_0), the int4 kernel's group size
QTYPES = ("Q4_0", "Q4_1")  # matrices kept packed; other types are dequantized (fp32) as before
ACT_DTYPE = torch.bfloat16  # the int4 kernel's fast activation dtype


class Q4Rows:
    """Rows of a 4-bit GGUF matrix [out, in], unpacked while loading: q uint8 [out, in] (0..15),
    d and m float32 [out, in / 32] (w = d*q + m). It offers the narrow / copy_ / shape / data
    that linear.py's weight loaders use on a tensor, so the same loaders place the shards of fused
    layers (qkv, gate_up) into a layer's Q4Rows as they place dequantized ones into its weight."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
        self.q, self.d, self.m = q, d, m

    @classmethod
    def empty(cls, rows: int, cols: int) -> Q4Rows:
        return cls(torch.empty(rows, cols, dtype=torch.uint8), torch.empty(rows, cols // GROUP),
                   torch.empty(rows, cols // GROUP))

    @classmethod
    def from_blocks(cls, raw: np.ndarray, qtype: str, rows: int, cols: int) -> Q4Rows:
        """raw: the GGUF tensor's bytes [rows, cols/32 * block]: Q4_1 blocks are d (f16), m (f16),
        16 bytes of q (byte j holds q[j] low and q[j+16] high); Q4_0 blocks lack m (m = -8d)."""
        head = 4 if qtype == "Q4_1" else 2
        b = np.ascontiguousarray(raw).reshape(rows, cols // GROUP, head + GROUP // 2)
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if head == 4 else -8.0 * d
        qs = b[..., head:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
        return cls(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def data(self) -> Q4Rows:
        return self

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> Q4Rows:
        if dim == 0:
            return Q4Rows(self.q.narrow(0, start, length), self.d.narrow(0, start, length),
                          self.m.narrow(0, start, length))
        if start % GROUP or length % GROUP:
            raise ValueError(f"a 4-bit GGUF matrix splits along `in` only at multiples of {GROUP}")
        g0, gn = start // GROUP, length // GROUP
        return Q4Rows(self.q.narrow(1, start, length), self.d.narrow(1, g0, gn), self.m.narrow(1, g0, gn))

    def copy_(self, src: Q4Rows) -> Q4Rows:
        self.q.copy_(src.q)
        self.d.copy_(src.d)
        self.m.copy_(src.m)
        return self

    def map_rows(self, fn) -> Q4Rows:  # type: ignore[no-untyped-def]
        """The same rows reordered by fn (a function of a [out, ...] tensor, e.g. gguf_loader's unpermute)."""
        return Q4Rows(fn(self.q), fn(self.d), fn(self.m))

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: d*q + m, the values gguf's own dequantization gives."""
        n, k = self.q.shape
        w = self.q.view(n, k // GROUP, GROUP).float() * self.d.unsqueeze(-1) + self.m.unsqueeze(-1)
        return w.reshape(n, k)


class Int4Linear:
    """y = x @ W.T (+ b) with W packed by torch's CPU int4 kernel. x [T, in] in any float dtype ->
    y [T, out] in x's dtype; the product runs on bf16 inputs with fp32 accumulation. Each row's
    result does not depend on the other rows or the thread count (tests/test_cpu_weights.py), so
    it is batch-invariant as it is. A plain callable, not a Module: it runs 121 times a decode step."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, repeat_input: int = 1):
        """q uint8 [out, in'] (0..15), scale and zero float32 [out, in' / 32]; w = (q - 8)*scale + zero.
        repeat_input: in' = repeat_input * in (the Q8_0 nibble split feeds x twice)."""
        self.out_features, self.in_features = q.shape[0], q.shape[1] // repeat_input
        self.repeat_input = repeat_input
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.packed = packed  # uint8 [out, in' / 2]
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [in' / 32, out, 2]
        self.scale_zero = sz.to(ACT_DTYPE)

    @classmethod
    def from_q4(cls, rows: Q4Rows) -> Int4Linear:
        return cls(rows.q, rows.d, rows.m + 8.0 * rows.d)

    @classmethod
    def from_q8_0(cls, raw: np.ndarray, rows: int, cols: int) -> Int4Linear:
        """raw: Q8_0 blocks [rows, cols/32 * 34]: d (f16), 32 int8 q; w = d*q."""
        b = np.ascontiguousarray(raw).reshape(rows, cols // GROUP, 2 + GROUP)
        d = torch.from_numpy(b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
        u = torch.from_numpy(b[..., 2:].copy().view(np.int8).astype(np.int16) + 128).reshape(rows, cols)
        hi, lo = (u >> 4).to(torch.uint8), (u & 0x0F).to(torch.uint8)
        q = torch.cat([hi, lo], dim=1)  # [rows, 2*cols]: the high nibbles' groups, then the low ones'
        scale = torch.cat([16.0 * d, d], dim=1)
        zero = torch.cat([torch.zeros_like(d), 8.0 * d], dim=1)
        return cls(q, scale, zero, repeat_input=2)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        xa = x.to(ACT_DTYPE)
        if self.repeat_input > 1:
            xa = torch.cat([xa] * self.repeat_input, dim=-1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xa, self.packed, GROUP, self.scale_zero).to(x.dtype)
        return y if bias is None else y + bias


class Int4LMHead(nn.Module):
    """The LM head on packed weights for small batches (layers.linear.int4_rows), the model's float
    head (`full`: ParallelLMHead, one rank) for large ones: hidden [n, H] -> logits [n, V].

    The int4 product returns bf16, whose step at a logit of 16-32 is 0.125: two candidates 0.08
    apart in fp32 come out tied, and greedy picks by index. So the `refine` largest logits of each
    row (where the choice is made) are recomputed in fp32 from the float matrix (the dequantized
    GGUF values: [V, H], the embedding table when tied); the rest keep bf16's resolution."""

    def __init__(self, linear: Int4Linear, full: nn.Module, refine: int = 32):
        super().__init__()
        self.linear = linear
        self.full = full
        self.refine = refine

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from nanokv.compute_service.model.layers.linear import int4_rows

        if not int4_rows(hidden):
            return self.full(hidden)
        logits = self.linear(hidden)
        idx = logits.topk(self.refine, dim=-1).indices  # [n, k]
        w: torch.Tensor = self.full.weight  # type: ignore[assignment]  # [V, H]
        exact = torch.bmm(w[idx], hidden.unsqueeze(-1)).squeeze(-1)  # [n, k, H] @ [n, H, 1]
        return logits.scatter_(-1, idx, exact.to(logits.dtype))
