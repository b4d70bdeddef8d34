"""Block copies between the device pool (L1) and the page-locked host tier (L2), run by the GPU itself.

A load or a write-back moves rows of one layer tensor, [blocks, ...] on each side, from scattered
source rows to scattered destination rows. Done by the host, a load is a gather on the CPU into a
pinned bounce buffer (a memcpy at a few GB/s on the step's thread) and a write-back is a scatter
on the CPU after the device's copy completes. The host segment is page-locked (cudaHostRegister, or
pinned in process), and under unified addressing its pointer is valid on the device, so a kernel
reads or writes it in place over the link: one launch per tensor, no bounce buffer, no host work,
and the copy is ordered on the step's stream like any kernel.

Grid (rows, chunks): a program moves CHUNK 32-bit words of one row, src[src_rows[r]] ->
dst[dst_rows[r]]. Rows are whole blocks, so the words of a program are contiguous on both sides and
a warp's accesses coalesce into full link transactions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048  # 32-bit words per program (8 KiB)


@triton.jit
def _copy_rows(src, dst, src_rows, dst_rows, row_words, CHUNK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    s = tl.load(src_rows + r).to(tl.int64)
    d = tl.load(dst_rows + r).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < row_words
    v = tl.load(src + s * row_words + offs, mask=mask)
    tl.store(dst + d * row_words + offs, v, mask=mask)


def words(t: torch.Tensor) -> torch.Tensor:
    """The tensor as [rows, row_words] int32, a view of its bytes. A row (one block) must be dense,
    in any order inside (int8/int4 V blocks are stored transposed), and a whole number of words."""
    strides = t.stride()
    inner = sorted(range(1, t.dim()), key=lambda i: -strides[i])
    dense = t.permute(0, *inner)
    if not dense.is_contiguous():
        raise ValueError(f"a block row of shape {tuple(t.shape[1:])} and strides {t.stride()[1:]} is not dense")
    flat = dense.view(torch.uint8).reshape(t.shape[0], -1)
    if flat.shape[1] % 4:
        raise ValueError(f"a block row of {flat.shape[1]} bytes is not a whole number of 32-bit words")
    return flat.view(torch.int32)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for every i; one side may be page-locked host memory.

    src, dst: [blocks, ...] of one dtype and row shape; src_rows, dst_rows: [n] int64 on the device."""
    n = src_rows.numel()
    if n == 0:
        return
    if src.stride()[1:] != dst.stride()[1:] or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"rows laid out differently: {tuple(src.shape)} {src.stride()} and "
                         f"{tuple(dst.shape)} {dst.stride()}")
    s, d = words(src), words(dst)
    if s.shape[1] != d.shape[1]:
        raise ValueError(f"row sizes differ: {s.shape[1]} and {d.shape[1]} words")
    row_words = s.shape[1]
    _copy_rows[(n, triton.cdiv(row_words, CHUNK))](s, d, src_rows, dst_rows, row_words, CHUNK=CHUNK)
