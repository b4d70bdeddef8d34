"""Hybrid sparsity's INT8 -> INT4 demotion copy: the Triton kernel (nanokv.kernels.triton_demote,
one launch per layer on the GPU) writes the same bytes as the torch reference (DemotedBlocks.write).
CPU: TRITON_INTERPRET=1."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
pytest.importorskip("triton")

from nanokv.kernels.triton_demote import demote_blocks  # noqa: E402
from nanokv.kernels.triton_store import store_kvcache  # noqa: E402
from nanokv.kv.cache import allocate_layer_cache  # noqa: E402
from nanokv.kv.demote import DemotionStore  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _filled_int8(num_blocks: int, H: int, bs: int, D: int, g: torch.Generator):
    """An int8 layer whose every block holds rows of very different ranges, one constant channel
    (its rows' int4 step decides ties) and, in block 1, an all-zero row (scale underflows -> 1.0)."""
    cache = allocate_layer_cache(8, num_blocks, H, bs, D, torch.float32, DEV, rotate=False)
    T = num_blocks * bs
    k = torch.randn(T, H, D, generator=g) * torch.logspace(-2, 1, D)
    v = torch.randn(T, H, D, generator=g) * 3
    k[:, :, 7] = 0.5
    k[bs + 2], v[bs + 3] = 0.0, 0.0
    store_kvcache(k.to(DEV), v.to(DEV), cache, torch.arange(T, device=DEV))
    return cache


@pytest.mark.parametrize("H,bs,D", [(2, 16, 64), (1, 32, 128)])
def test_demote_kernel_writes_the_reference_bytes(H: int, bs: int, D: int) -> None:
    got = [_filled_int8(6, H, bs, D, torch.Generator().manual_seed(H * bs + D))]
    # the reference runs on the CPU: torch on CUDA divides by a Python scalar as a product with its
    # reciprocal (not IEEE division), which moves an fp16 scale by one ulp in about 1% of rows
    want = [dataclasses.replace(got[0], **{n: t.cpu().clone() for n, t in got[0].tensors().items()})]
    ref, tri = DemotionStore(want, 5), DemotionStore(got, 5)
    tri.write_layer = demote_blocks
    blocks, slots = [4, 1, 0], [2, 0, 4]
    ref.demote(blocks, slots)
    tri.demote(blocks, slots)
    for a, b in zip(ref.layers(), tri.layers()):
        for name, x in vars(a.demoted).items():
            y = getattr(b.demoted, name)
            assert torch.equal(x, y.cpu()), f"{name}: {(x.float() - y.cpu().float()).abs().max()} max difference"
    # a slot never written stays zero, and a written one is not (the copy really happened)
    assert not bool(tri.layers()[0].demoted.k[1].any()) and bool(tri.layers()[0].demoted.k[2].any())
