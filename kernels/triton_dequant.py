"""Register-level dequantization of int8 / int4 KV codes to fp16 (never written back to memory).

Two ways in. Words (load_code_words: int4, and int8 keys in the untransposed kernels): codes are
read as int32 words (4 codes each, one 16-byte load per 4 words) and expanded in registers to an
fp16 [BLOCK_N, BLOCK_DH] tile in row layout, which the compiler then moves to the tensor-core operand
layout through shared memory (16-bit, transposing loads), like a bf16 cache. Int8 tiles
(int8_tile_f16: the transposed int8 decode, int8 values everywhere): when the tile's inner
(summed) dimension is contiguous in memory, the compiler copies the codes to shared memory as they
are and loads them straight into the operand layout, converting there, with no fp16 round trip.
That is why int8 values are stored dims-major (nanokv.kv.cache); read token-major as a V^T operand,
an int8 tile is gathered one byte per shared load instead (seen in SASS).

Conversion: for 0 <= m < 1024 the fp16 bit pattern of 1024 + m is 0x6400 + m, so a byte or nibble
spliced under an 0x64 high byte and one fp16 subtraction give the code exactly, without the
quarter-rate integer-to-float instruction. int8 codes are first biased to unsigned (x ^ 0x80).
On NVIDIA GPUs the splice is one PTX byte permute per two codes (ASM); the plain Triton version
(shifts and masks) is the one the CPU interpreter runs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def use_asm(device: torch.device) -> bool:
    """Inline PTX runs on NVIDIA GPUs only (not under TRITON_INTERPRET=1, which runs on the CPU)."""
    return device.type == "cuda" and torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"


def use_words(quantized: bool, cdt: tl.dtype, head_dim: int) -> bool:
    """Word reads need fp16 compute and D/2 a power of 2 >= 16 (one tile row = whole words)."""
    half = head_dim // 2
    return quantized and cdt == tl.float16 and half >= 16 and half & (half - 1) == 0


@triton.jit
def _byte_f16(w, SHIFT: tl.constexpr, NIBBLE: tl.constexpr):
    """One code lane of each int32 word -> fp16, exactly."""
    if NIBBLE:
        return (((w >> SHIFT) & 0xF) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    else:  # (b & 0xFF) ^ 0x6480 = 0x64 high byte | (b ^ 0x80); value 1024 + b + 128 for signed b
        return (((w >> SHIFT) & 0xFF) ^ 0x6480).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0


# 4 int8 codes in b32 register `src` -> fp16 pairs in `lo` (codes 0, 1) and `hi` (codes 2, 3):
# bias to unsigned, splice each byte under 0x64 (fp16 1024 + 128 + code), subtract 1152
_INT8_SPLICE = """
        .reg .b32 t, z, c;
        mov.b32 z, 0x64646464;
        mov.b32 c, 0x64806480;
        xor.b32 t, {src}, 0x80808080;
        prmt.b32 {lo}, t, z, 0x4140;
        prmt.b32 {hi}, t, z, 0x4342;
        sub.f16x2 {lo}, {lo}, c;
        sub.f16x2 {hi}, {hi}, c;"""
# (jit code may read module globals only as constexpr)
_INT8_WORD_PTX = tl.constexpr("{ .reg .b32 a, b;" + _INT8_SPLICE.format(src="$4", lo="a", hi="b")
                              + " mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }")
_INT8_TILE_PTX = tl.constexpr("{" + _INT8_SPLICE.format(src="$2", lo="$0", hi="$1") + " }")


@triton.jit
def _int8_word_asm(w):
    """int32 word of 4 int8 codes -> 4 fp16 (code j of the word in output j)."""
    return tl.inline_asm_elementwise(
        _INT8_WORD_PTX,
        "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)


@triton.jit
def int8_tile_f16(c, ASM: tl.constexpr):
    """An int8 code tile of any shape -> fp16, exactly. ASM: four codes per PTX call, as
    _int8_word_asm, on whatever register layout the compiler gives the tile (the transposed decode
    loads int8 tiles straight into the tensor-core operand layout); else a plain conversion."""
    if ASM:
        return tl.inline_asm_elementwise(_INT8_TILE_PTX, "=r,=r,r", [c], dtype=tl.float16, is_pure=True,
                                         pack=4)
    else:
        return c.to(tl.float16)


# 4 bytes in b32 register $2 -> fp16 1024 + code of their low (or high) nibbles in $0 (bytes 0-1) and
# $1 (bytes 2-3): spread the bytes over half-words, (shift,) mask a nibble, splice it under 0x6400
# (lop3 0xEA = (a & b) | c), subtract 1024: the int8 splice's trick. One output per call (ptxas
# shares the two calls' byte spreads: the transposed int4 loop is as long as with one two-output call).
_INT4_NIB = """{{
    .reg .b32 x, y, z, m, o;
    mov.b32 z, 0;
    mov.b32 m, 0x000F000F;
    mov.b32 o, 0x64006400;
    prmt.b32 x, $2, z, 0x4140;
    prmt.b32 y, $2, z, 0x4342;{shift}
    lop3.b32 $0, x, m, o, 0xEA;
    lop3.b32 $1, y, m, o, 0xEA;
    sub.f16x2 $0, $0, o;
    sub.f16x2 $1, $1, o;
    }}"""
_INT4_LO_PTX = tl.constexpr(_INT4_NIB.format(shift=""))
_INT4_HI_PTX = tl.constexpr(_INT4_NIB.format(shift="\n    shr.b32 x, x, 4;\n    shr.b32 y, y, 4;"))


@triton.jit
def int4_tile_f16(c, ASM: tl.constexpr):
    """A uint8 tile of packed int4 codes (any shape) -> (low nibbles, high nibbles) as fp16 tiles of
    the same shape, exactly; ASM: four bytes per PTX call in whatever layout the tile has."""
    if ASM:
        return (tl.inline_asm_elementwise(_INT4_LO_PTX, "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4),
                tl.inline_asm_elementwise(_INT4_HI_PTX, "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4))
    else:
        return (c & 15).to(tl.float16), (c >> 4).to(tl.float16)


@triton.jit
def _int4_word_asm(w):
    """int32 word of 4 packed bytes -> 8 fp16: low nibbles of bytes 0..3, then high nibbles."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 x, y, t, z, m, o, a, b, c, d;
        mov.b32 z, 0;
        mov.b32 m, 0x000F000F;
        mov.b32 o, 0x64006400;
        prmt.b32 x, $8, z, 0x4140;
        prmt.b32 y, $8, z, 0x4342;
        lop3.b32 a, x, m, o, 0xEA;
        lop3.b32 b, y, m, o, 0xEA;
        shr.b32 t, x, 4;
        lop3.b32 c, t, m, o, 0xEA;
        shr.b32 t, y, 4;
        lop3.b32 d, t, m, o, 0xEA;
        sub.f16x2 a, a, o;
        sub.f16x2 b, b, o;
        sub.f16x2 c, c, o;
        sub.f16x2 d, d, o;
        mov.b32 {$0, $1}, a;
        mov.b32 {$2, $3}, b;
        mov.b32 {$4, $5}, c;
        mov.b32 {$6, $7}, d;
        }""",
        "=h,=h,=h,=h,=h,=h,=h,=h,r", [w], dtype=(tl.float16,) * 8, is_pure=True, pack=1)


@triton.jit
def _interleave4(o0, o1, o2, o3, BLOCK_N: tl.constexpr, BLOCK_DH: tl.constexpr):
    """[BLOCK_N, BLOCK_DH / 4] x 4 (code j of each word) -> [BLOCK_N, BLOCK_DH], dim 4 * word + j."""
    return tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), [BLOCK_N, BLOCK_DH])


@triton.jit
def load_code_words(c_ptr, rows, valid, HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DH: tl.constexpr,
                    BITS: tl.constexpr, ASM: tl.constexpr):
    """One quantized K or V tile as fp16: int8 -> [BLOCK_N, BLOCK_DH] of head-dim half HALF;
    int4 -> (dims [0, D/2), dims [D/2, D)) from the low and high nibbles.

    c_ptr: int32 view of the codes; rows: [BLOCK_N] byte offsets of each token's code row;
    valid: [BLOCK_N] (masked rows read as zeros)."""
    offs_w = tl.arange(0, BLOCK_DH // 4)
    w = tl.load(c_ptr + (rows // 4)[:, None] + HALF * (BLOCK_DH // 4) + offs_w[None, :],
                mask=valid[:, None], other=0)  # [BLOCK_N, BLOCK_DH / 4] int32
    if BITS == 8:
        if ASM:
            o0, o1, o2, o3 = _int8_word_asm(w)
        else:
            o0, o1, o2, o3 = _byte_f16(w, 0, False), _byte_f16(w, 8, False), _byte_f16(w, 16, False), \
                _byte_f16(w, 24, False)
        return _interleave4(o0, o1, o2, o3, BLOCK_N, BLOCK_DH)
    else:
        if ASM:
            l0, l1, l2, l3, h0, h1, h2, h3 = _int4_word_asm(w)
        else:
            l0, l1, l2, l3 = _byte_f16(w, 0, True), _byte_f16(w, 8, True), _byte_f16(w, 16, True), \
                _byte_f16(w, 24, True)
            h0, h1, h2, h3 = _byte_f16(w, 4, True), _byte_f16(w, 12, True), _byte_f16(w, 20, True), \
                _byte_f16(w, 28, True)
        lo = _interleave4(l0, l1, l2, l3, BLOCK_N, BLOCK_DH)
        return lo, _interleave4(h0, h1, h2, h3, BLOCK_N, BLOCK_DH)
