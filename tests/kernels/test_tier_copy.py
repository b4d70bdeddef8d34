"""The tier copy kernel (kernels/triton_tier_copy.py) moves whole block rows of every field of every
KV format, scattered to scattered, and nothing else (CPU: TRITON_INTERPRET=1; the device runs it
against page-locked host memory in tools/nanokv_tools/bench/gpu_tiers.py)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
pytest.importorskip("triton")

from nanokv.kernels.triton_tier_copy import copy_rows  # noqa: E402
from nanokv.kv.cache import allocate_layer_cache  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _fill(t: torch.Tensor, gen: torch.Generator) -> None:
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8))


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_copy_rows_moves_exactly_the_named_blocks(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    src = allocate_layer_cache(bits, 9, 2, 16, 64, torch.float16, "cpu")
    dst = allocate_layer_cache(bits, 7, 2, 16, 64, torch.float16, DEV)
    for name in src.block_fields:
        _fill(getattr(src, name), gen)
    srcs = {name: getattr(src, name) for name in src.block_fields}
    if DEV == "cuda":  # the host side as the tier has it: page-locked, same strides (V blocks transposed)
        for name, t in srcs.items():
            srcs[name] = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, pin_memory=True).copy_(t)
    before = {name: getattr(dst, name).clone() for name in dst.block_fields}
    src_rows, dst_rows = [8, 0, 3, 5], [2, 6, 0, 3]
    s = torch.tensor(src_rows, device=DEV)
    d = torch.tensor(dst_rows, device=DEV)
    for name in src.block_fields:
        copy_rows(srcs[name], getattr(dst, name), s, d)
    for name in dst.block_fields:
        got, want = getattr(dst, name).cpu(), before[name].cpu()
        want[dst_rows] = srcs[name][src_rows]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


def test_a_row_that_is_not_whole_words_is_refused() -> None:
    a = torch.zeros(4, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="32-bit words"):
        copy_rows(a, a.clone(), torch.tensor([0]), torch.tensor([1]))
