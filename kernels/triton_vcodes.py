"""Quantized value codes read from dims-major blocks (int8 and int4; nanokv.kv.cache) as token-major
tiles, for the kernels whose value product takes [BLOCK_N, BLOCK_DH] tiles (the paged prefill, the
untransposed decodes). A tile may span several blocks or part of one: it is read as runs of tokens
that share a block, each with tokens contiguous in memory (vector loads), one table read per run,
and converted to the compute dtype in the load layout.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanokv.kernels.triton_dequant import int4_tile_f16, int8_tile_f16


@triton.jit
def _value_runs(v_ptr, bt_row_ptr, start, hi, kvh, stride_n, stride_h, rows, d_mask, BS: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Value codes of tokens [start, start + BLOCK_N) (start % BLOCK_N == 0) at byte rows `rows`
    [BLOCK_DH] of the dims-major block ([N, H, D, bs], int4 [N, H, D/2, bs]; nanokv.kv.cache), as
    [NB, BLOCK_DH, TB]: runs of TB tokens that share a block, tokens contiguous (vector loads), one
    table read per run. Not masked by token: a token past hi or in a hole reads block 0, whose codes
    are finite, and its softmax weight is 0."""
    TB: tl.constexpr = BS if BS < BLOCK_N else BLOCK_N
    NB: tl.constexpr = BLOCK_N // TB
    tok0 = start + tl.arange(0, NB) * TB  # [NB] first token of each run
    phys = tl.load(bt_row_ptr + tok0 // BS, mask=tok0 < hi, other=-1)
    base = tl.maximum(phys, 0).to(tl.int64) * stride_n + kvh * stride_h + tok0 % BS
    base = tl.multiple_of(base, TB)  # stride_n, stride_h are multiples of 16, tok0 % BS of TB
    ptr = v_ptr + base[:, None, None] + rows[None, :, None] * BS + tl.arange(0, TB)[None, None, :]
    return tl.load(ptr, mask=d_mask[None, :, None], other=0)


@triton.jit
def _runs_tile(c, BLOCK_DH: tl.constexpr, BLOCK_N: tl.constexpr):
    """[NB, BLOCK_DH, TB] runs -> the [BLOCK_N, BLOCK_DH] tile (token-major, as the products take it)."""
    return tl.trans(tl.reshape(tl.permute(c, (1, 0, 2)), [BLOCK_DH, BLOCK_N]))


@triton.jit
def int8_value_codes(v_ptr, bt_row_ptr, start, hi, kvh, stride_n, stride_h, offs_d, d_mask, HALF: tl.constexpr,
                     DH: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, CDT: tl.constexpr,
                     ASM: tl.constexpr):
    """int8 value codes of tokens [start, start + BLOCK_N), dims HALF * DH + offs_d, as a
    [BLOCK_N, BLOCK_DH] tile in CDT (converted exactly, in the load layout; see _value_runs)."""
    c = _value_runs(v_ptr, bt_row_ptr, start, hi, kvh, stride_n, stride_h, HALF * DH + offs_d, d_mask, BS, BLOCK_N)
    return _runs_tile(_codes_to(c, CDT, ASM), offs_d.shape[0], BLOCK_N)


@triton.jit
def int4_value_codes(v_ptr, bt_row_ptr, start, hi, kvh, stride_n, stride_h, offs_d, d_mask, BS: tl.constexpr,
                     BLOCK_N: tl.constexpr, CDT: tl.constexpr, ASM: tl.constexpr):
    """int4 value codes of tokens [start, start + BLOCK_N) as two [BLOCK_N, BLOCK_DH] tiles in CDT,
    dims offs_d (low nibbles) and D/2 + offs_d (high); see _value_runs."""
    c = _value_runs(v_ptr, bt_row_ptr, start, hi, kvh, stride_n, stride_h, offs_d, d_mask, BS, BLOCK_N)
    if CDT == tl.float16:
        c_lo, c_hi = int4_tile_f16(c, ASM)
    else:
        c_lo, c_hi = (c & 15).to(CDT), (c >> 4).to(CDT)
    return _runs_tile(c_lo, offs_d.shape[0], BLOCK_N), _runs_tile(c_hi, offs_d.shape[0], BLOCK_N)


@triton.jit
def _codes_to(c, CDT: tl.constexpr, ASM: tl.constexpr):
    """int8 code tile -> CDT; fp16 through the PTX byte splice where it runs (triton_dequant)."""
    if CDT == tl.float16:
        return int8_tile_f16(c, ASM)
    else:
        return c.to(CDT)
