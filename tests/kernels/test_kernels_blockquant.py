"""Graph-safe int4 quantize-on-fill (Triton, blocks found on the device from the slot mapping) vs the
eager torch path (nanokv.kv.blockquant.quantize_filled, from the host's fill list): identical caches.
CPU: TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nanokv.kernels import reference  # noqa: E402
from nanokv.kernels.triton_blockquant import div_by_recip, quantize_filled_graphsafe  # noqa: E402
from nanokv.kv.blockquant import quantize_filled  # noqa: E402
from nanokv.kv.cache import allocate_layer_cache  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, D = 2, 32
NAMES = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero", "k_stage", "v_stage")


def _rows(n: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """[n, H, D]: channels of different scale plus a constant channel (scale underflows -> 1) and one
    taking 0, 0.25, 7.5 (a block holding 0 and 7.5 has step 0.5, so 0.25 is a round-half-even tie)."""
    x = torch.randn(n, H, D, generator=g) * torch.logspace(-1, 1, D)
    x[:, :, 3] = 0.75
    x[:, :, 5] = torch.tensor([0.0, 0.25, 7.5])[torch.randint(0, 3, (n, H), generator=g)]
    return x.to(dtype)


def _steps(bs: int, g: torch.Generator) -> list[list[tuple[int, int]]]:
    """Per step, per sequence (first position, new tokens): three prompts in chunks, then decodes."""
    steps = [[(0, 2 * bs + 3), (0, bs - 1), (0, 5)], [(2 * bs + 3, bs), (bs - 1, 1), (5, 2 * bs)]]
    pos = [3 * bs + 3, bs, 2 * bs + 5]
    for _ in range(bs + 3):
        steps.append([(p, 1) for p in pos])
        pos = [p + 1 for p in pos]
    return steps


@pytest.mark.parametrize("recip", [False, True])
@pytest.mark.parametrize("bs,dtype,compact", [(8, torch.float32, False), (8, torch.float16, False),
                                              (16, torch.float16, False), (8, torch.float16, True)])
def test_graphsafe_fill_quant_equals_eager(dtype: torch.dtype, bs: int, compact: bool, recip: bool) -> None:
    """The kernel given the step's whole slot mapping (captured decode steps, with padding rows) or
    only the filled blocks' last slots (StageTable.last_slots: eager steps) quantizes exactly what the
    torch quantize_filled does, dividing by the scale or by its reciprocal with corrections."""
    g = torch.Generator().manual_seed(bs)
    nblk = 24
    caches = [allocate_layer_cache(4, nblk, H, bs, D, dtype, DEV, rotate=False) for _ in range(2)]
    tables = torch.randperm(nblk, generator=g).view(3, nblk // 3)  # each sequence's blocks, scattered
    for step in _steps(bs, g):
        slots = np.concatenate([tables[i, (np.arange(p, p + n) // bs)].numpy() * bs + np.arange(p, p + n) % bs
                                for i, (p, n) in enumerate(step)])
        k, v = _rows(len(slots), g, dtype), _rows(len(slots), g, dtype)
        given = torch.tensor(np.concatenate([slots, [-1, -1, -1]]), device=DEV)  # graph bucket padding
        for c in caches:
            c.stage.plan(slots)
            reference.store_kvcache(k.to(DEV), v.to(DEV), c, torch.from_numpy(slots).to(DEV))
        if compact:
            last = caches[1].stage.last_slots()
            assert set(last.tolist()) == {int(s) for s in slots if s % bs == bs - 1}
            given = torch.from_numpy(last).to(DEV)
        quantize_filled(caches[0])
        quantize_filled_graphsafe(caches[1], given, recip=recip)
        for c in caches:
            c.stage.finish()
        for n in NAMES:
            a, b = getattr(caches[0], n), getattr(caches[1], n)
            assert torch.equal(a, b), n
    assert int(caches[0].k_scale.count_nonzero()) > 0  # blocks were quantized at all


@triton.jit
def _div_kernel(d_ptr, s_ptr, out_ptr, n, RECIP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    d = tl.load(d_ptr + offs, mask=m, other=0.0)
    s = tl.load(s_ptr + offs, mask=m, other=1.0)
    if RECIP:
        q = div_by_recip(d, s, tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s))
    else:
        q = tl.div_rn(d, s)
    tl.store(out_ptr + offs, q, mask=m)


def test_division_by_corrected_reciprocal_is_correctly_rounded() -> None:
    """div_by_recip equals IEEE division bit for bit where the fill kernel uses it: dividends x - zero
    of 16-bit values (zero included), fp16 scales, and quotients at and next to the half-integer
    ties that round-half-even resolves (c + 0.5) * s, one ulp either side."""
    g = torch.Generator().manual_seed(7)
    n = 1 << 15
    s = (torch.rand(n, generator=g) * torch.logspace(-6, 3, n)).half().float().clamp_min(6e-8)
    codes = torch.randint(0, 15, (n,), generator=g).float() + 0.5
    tie = (codes * s).float()
    d = torch.cat([tie, torch.nextafter(tie, torch.full_like(tie, 1e30)), torch.nextafter(tie, torch.zeros_like(tie)),
                   torch.rand(n, generator=g) * 15.9 * s, torch.zeros(n),
                   (torch.randn(n, generator=g).half().float() - torch.randn(n, generator=g).half().float()).abs()])
    s = s.repeat(6)
    want = d / s  # IEEE division (torch's fp32 on the CPU)
    for recip in (False, True):
        out = torch.empty_like(d)
        dd, ss, oo = d.to(DEV), s.to(DEV), out.to(DEV)
        _div_kernel[(triton.cdiv(d.numel(), 1024),)](dd, ss, oo, d.numel(), RECIP=recip, BLOCK=1024)
        got = oo.cpu()
        bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero().flatten()
        assert bad.numel() == 0, (recip, d[bad[:4]].tolist(), s[bad[:4]].tolist(), got[bad[:4]].tolist())
