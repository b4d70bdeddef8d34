"""The decode kernels compile for an H100/H200 (sm_90) through Triton's real compiler, on the CPU.

The interpreter (TRITON_INTERPRET=1, the other kernel tests) runs the Python semantics only; typing
rules of the compiler (a loop-carried variable changing type, one return type per jit function,
dot operand shapes) are checked only here and on the GPU. Triton's wheel ships ptxas, so this needs
no GPU; it is skipped where the NVIDIA backend is missing.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
pytest.importorskip("triton.backends.nvidia")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nanokv.kernels.triton_decode import _decode_kernel  # noqa: E402
from nanokv.kernels.triton_decode_int4 import decode_int4_kernel, int4_tiles  # noqa: E402

PTRS = dict(q_ptr="*bf16", k_ptr="*i32", v_ptr="*i32", ks_ptr="*fp16", vs_ptr="*fp16", kz_ptr="*fp16",
            vz_ptr="*fp16", kst_ptr="*bf16", vst_ptr="*bf16", stage_ptr="*i32", bt_ptr="*i32",
            seq_lens_ptr="*i32", out_ptr="*bf16", part_o_ptr="*fp32", part_ml_ptr="*fp32", qk_scale="fp32")


def _compile(bits: int, block_n: int, warps: int, lazy_tau: int = 0, min_rows: int = 16) -> int:
    """Qwen3-0.6B decode shapes (G 2, D 128, 16-token blocks); returns the SASS size in bytes."""
    fn = decode_int4_kernel if bits == 4 else _decode_kernel
    const = dict(D=128, DH=64, G=2, BS=16, CDT=tl.float16, ASM=True, WORDS=True, FOLD_V=True, BLOCK_DH=64,
                 BLOCK_N=block_n, SPLIT=True, LAZY_TAU=lazy_tau)
    sig = dict(PTRS)
    if bits == 16:
        sig.update(k_ptr="*bf16", v_ptr="*bf16")
        const.update(CDT=tl.bfloat16, WORDS=False)
    if bits == 4:
        const.update(int4_tiles(2, 16, block_n, min_rows))
    else:
        const.update(BITS=bits, BLOCK_G=max(min_rows, 2))
    names = fn.arg_names
    sig = {n: ("constexpr" if n in const else sig.get(n, "i32")) for n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=2))
    return len(ck.asm["cubin"])


@pytest.mark.parametrize("bits,block_n,warps,lazy_tau,min_rows", [
    (16, 64, 8, 0, 16),  # bf16 default
    (8, 32, 1, 0, 16), (8, 32, 1, 8, 16), (8, 32, 1, 0, 1),  # int8 default, lazy rescaling, rows in the MMA
    (4, 32, 1, 0, 1), (4, 32, 1, 8, 1), (4, 32, 1, 0, 16), (4, 128, 4, 0, 1),  # int4 default and variants
])
def test_decode_kernel_compiles_for_sm90(bits: int, block_n: int, warps: int, lazy_tau: int, min_rows: int) -> None:
    assert _compile(bits, block_n, warps, lazy_tau, min_rows) > 10_000
