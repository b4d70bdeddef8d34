"""Compile the decode kernels (and the q/k norm + RoPE, RMSNorm, SiLU-and-mul kernels) for sm_90 on any machine.

  python -m nanokv_tools.bench.compile_sm90 [--sass DIR]

Triton's wheel ships ptxas and cuobjdump, so its real compiler runs on the CPU. This checks what
the interpreter (TRITON_INTERPRET=1) does not: the compiler's typing rules (a loop-carried variable
changing type, one return type per jit function, dot shapes), and reports registers and shared
memory per variant, the figures that set occupancy. Must run without TRITON_INTERPRET (the kernels
are then built as interpreted functions).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanokv.kernels.triton_decode import _decode_kernel
from nanokv.kernels.triton_decode_int4 import decode_int4_kernel, int4_tiles
from nanokv.kernels.triton_decode_swap import decode_int8_swap_kernel
from nanokv.kernels.triton_decode_swap4 import decode_int4_swap_kernel
from nanokv.kernels.triton_kvtile import next_pow2
from nanokv.kernels.triton_norm import _rms_kernel, _silu_mul_kernel
from nanokv.kernels.triton_rope import _qk_norm_rope_kernel

PTRS = dict(q_ptr="*bf16", k_ptr="*i32", v_ptr="*i32", ks_ptr="*fp16", vs_ptr="*fp16", kz_ptr="*fp16",
            vz_ptr="*fp16", kst_ptr="*bf16", vst_ptr="*bf16", stage_ptr="*i32", bt_ptr="*i32",
            seq_lens_ptr="*i32", count_ptr="*i32", out_ptr="*bf16", part_o_ptr="*fp32", part_ml_ptr="*fp32",
            qk_scale="fp32")
# (bits, block_n, warps, lazy_tau, min_rows): the defaults and the variants the GPU bench times;
# min_rows -1 = int8 with the products transposed (triton_decode_swap); int4 transposed
# (triton_decode_swap4): -2 values dims-major, -3 token-major
VARIANTS = [(16, 64, 8, 0, 16), (8, 32, 1, 0, 16), (8, 32, 1, 8, 16), (8, 32, 1, 0, 1),
            (4, 32, 1, 0, 1), (4, 32, 1, 8, 1), (4, 32, 1, 0, 16), (4, 128, 4, 0, 1), (8, 16, 1, 0, -1),
            (4, 16, 1, 0, -2), (4, 16, 1, 0, -3)]


def compile_decode(bits: int, block_n: int, warps: int, lazy_tau: int = 0, min_rows: int = 16) -> bytes:
    """Qwen3-0.6B decode shapes (G 2, D 128, 16-token blocks, bf16 queries) -> the sm_90 cubin."""
    fn = (decode_int4_swap_kernel if min_rows < -1 else decode_int8_swap_kernel if min_rows < 0
          else decode_int4_kernel if bits == 4 else _decode_kernel)
    const = dict(D=128, DH=64, G=2, BS=16, CDT=tl.float16, ASM=True, WORDS=True, FOLD_V=True, BLOCK_DH=64,
                 BLOCK_N=block_n, SPLIT=True, LAZY_TAU=lazy_tau)
    ptrs = dict(PTRS)
    if bits == 16:
        ptrs.update(k_ptr="*bf16", v_ptr="*bf16")
        const.update(CDT=tl.bfloat16, WORDS=False)
    if bits == 8:  # int8 values are read as bytes (dims-major blocks); the transposed kernel's keys too
        ptrs.update(v_ptr="*i8", **({"k_ptr": "*i8"} if min_rows < 0 else {}))
    if bits == 4:  # int4 codes as bytes (both int4 kernels)
        ptrs.update(k_ptr="*u8", v_ptr="*u8")
    if min_rows < 0:
        const.update(BLOCK_G=2, MERGE=True, BLOCK_S=8)  # 8 splits merged in the kernel (the defaults)
        if min_rows < -1:  # a stride of 1 is specialized by the launcher
            const.update({"stride_vt" if min_rows == -2 else "stride_vd": 1}, PREFETCH=0)
    elif bits == 4:
        const.update(int4_tiles(2, 16, block_n, min_rows))
    else:
        const.update(BITS=bits, BLOCK_G=max(min_rows, 2))
    return _compile_specialized(fn, const, ptrs, warps)


def _compile_specialized(fn, const: dict, ptrs: dict, warps: int, strides: tuple[str, ...] = ()) -> bytes:
    """As the launcher specializes an attention kernel at these shapes: pointers 16-byte aligned,
    strides (stride_*, and those named) multiples of 16 (stride_bt is left unspecialized by the
    kernels; their loops' divisibility reasoning needs these), two pipeline stages."""
    names = fn.arg_names
    sig = {n: ("constexpr" if n in const else ptrs.get(n, "i32")) for n in names}
    div16 = [i for i, n in enumerate(names) if n not in const and (sig[n].startswith("*") or n in strides or (
        n.startswith("stride_") and n != "stride_bt"))]
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in div16})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=2))
    return ck.asm["cubin"]


def _compile(fn, const: dict, ptrs: dict, num_warps: int = 4) -> bytes:
    names = fn.arg_names
    sig = {n: ("constexpr" if n in const else ptrs.get(n, "i32")) for n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps)).asm["cubin"]


def compile_rope(rot: bool, tokens: int = 1) -> bytes:
    """The q/k norm + RoPE kernel at Qwen3-0.6B shapes (24 heads of 128, bf16 in, fp16 out for an
    int8 layer), with or without the KV rotation's dots, tokens per program -> the sm_90 cubin."""
    return _compile(_qk_norm_rope_kernel, dict(DH=64, BLOCK_H=32, BLOCK_DH=64, NORM=True, ROT=rot, PREC="tf32",
                                               TOK=tokens),
                    dict(x_ptr="*bf16", qw_ptr="*bf16", kw_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16",
                         r_ptr="*fp16", o_ptr="*fp16", eps="fp32"), 4 if tokens == 1 else 8)


def compile_norm(add: bool) -> bytes:
    """The RMSNorm kernel (with the residual add or not) at Qwen3-0.6B's hidden size, bf16."""
    return _compile(_rms_kernel, dict(BLOCK=1024, ADD=add),
                    dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", o_ptr="*bf16", s_ptr="*bf16", eps="fp32"))


def compile_fill(recip: bool = False) -> bytes:
    """The int4 quantize-on-fill kernel (triton_blockquant) at Qwen3-0.6B's head dim, 16-token blocks
    (recip: TritonConfig.fill_recip)."""
    from nanokv.kernels.triton_blockquant import _fill_quant_kernel
    return _compile(_fill_quant_kernel, dict(BS=16, DH=64, BLOCK_DH=64, RECIP=recip),
                    dict(slot_ptr="*i64", stage_ptr="*i32", kst_ptr="*bf16", vst_ptr="*bf16", kc_ptr="*u8",
                         vc_ptr="*u8", ks_ptr="*fp16", kz_ptr="*fp16", vs_ptr="*fp16", vz_ptr="*fp16"))


def compile_demote() -> bytes:
    """Hybrid's INT8 -> INT4 demotion copy (triton_demote) at Qwen3-0.6B's head dim, 16-token blocks,
    with the GPU's unfused product (EXACT)."""
    from nanokv.kernels.triton_demote import _demote_kernel
    return _compile(_demote_kernel, dict(BS=16, DH=64, BLOCK_DH=64, EXACT=True),
                    dict(ids_ptr="*i64", slots_ptr="*i64", kc_ptr="*i8", vc_ptr="*i8", ks_ptr="*fp16",
                         vs_ptr="*fp16", dk_ptr="*u8", dv_ptr="*u8", dks_ptr="*fp16", dkz_ptr="*fp16",
                         dvs_ptr="*fp16", dvz_ptr="*fp16"))


def compile_prefill(bits: int, kinds: bool = True, block_m: int = 64, warps: int = 4) -> bytes:
    """The paged prefill kernel at Qwen3-0.6B shapes (G 2, D 128; int4 at 32-token blocks, bf16 at 16)."""
    from nanokv.kernels.triton_prefill import _prefill_kernel
    q = bits < 16
    const = dict(D=128, DH=64, G=2, BS=32 if bits == 4 else 16, BITS=bits, CDT=tl.float16 if q else tl.bfloat16,
                 ASM=True, WORDS=q, BLOCK_M=block_m, TOKENS=block_m // 2, BLOCK_DH=64, BLOCK_N=64, KINDS=kinds)
    ptrs = dict(PTRS, qsl_ptr="*i32")
    ptrs.update({16: dict(k_ptr="*bf16", v_ptr="*bf16"), 8: dict(v_ptr="*i8"), 4: dict(v_ptr="*u8")}[bits])
    return _compile_specialized(_prefill_kernel, const, ptrs, warps)


def compile_hybrid(per_block: bool, block_n: int = 64, warps: int = 4, G: int = 4, bias: bool = False) -> bytes:
    """The hybrid-sparsity decode (nanokv.kernels.triton_hybrid) at Llama-3-8B shapes (G 4, D 128,
    16-token blocks, bf16 queries, 8 splits): the tile kernel (block_n-token tiles, codes as words) or,
    per_block, the block kernel (triton_hybrid_block: 16-token tiles, codes as bytes; bias: its BIAS). Code strides
    are multiples of 16 and the scales' token stride 1, as the launcher specializes them."""
    from nanokv.kernels.triton_hybrid import _decode_kernel as tile_kernel
    from nanokv.kernels.triton_hybrid_block import block_decode_kernel
    const = dict(D=128, DH=64, G=G, BS=16, CDT=tl.float16, ASM=True, BLOCK_N=block_n, SPLIT=True, s_s=1, a_s=1)
    ptrs = dict(q_ptr="*bf16", out_ptr="*bf16", part_o_ptr="*fp32", part_ml_ptr="*fp32", bt_ptr="*i32",
                lens_ptr="*i32", qk_scale="fp32", kc="*i8", vc="*i8", kp="*u8", vp="*u8",
                **{n: "*fp16" for n in ("ks", "vs", "ka", "kz", "va", "vz")})
    if per_block:
        const.update(BLOCK_G=next_pow2(G), BIAS=bias)
    else:
        const.update(WORDS=True, BLOCK_G=max(16, next_pow2(G)), BLOCK_DH=64)
        ptrs.update(kc="*i32", kp="*i32", vp="*i32")
    strides = ("c_n", "c_h", "c_s", "s_n", "s_h", "p_n", "p_h", "p_s", "a_n", "a_h")
    return _compile_specialized(block_decode_kernel if per_block else tile_kernel, const, ptrs, warps, strides)


def compile_silu() -> bytes:
    return _compile(_silu_mul_kernel, dict(BLOCK=1024), dict(x_ptr="*bf16", o_ptr="*bf16"))


OTHERS = {"rope rot=False": lambda: compile_rope(False), "rope rot=True": lambda: compile_rope(True),
          "rope rot=True tokens=4": lambda: compile_rope(True, 4),
          "norm add=False": lambda: compile_norm(False), "norm add=True": lambda: compile_norm(True),
          "silu_mul": compile_silu, "int4 fill": compile_fill, "int4 fill recip": lambda: compile_fill(True),
          "int8->int4 demote": compile_demote,
          "prefill bits=16": lambda: compile_prefill(16), "prefill bits=8": lambda: compile_prefill(8),
          "prefill bits=4": lambda: compile_prefill(4, True, 128, 8),  # int4's default rows / warps
          "prefill bits=4 kinds=0": lambda: compile_prefill(4, False),
          "hybrid tile block_n=64 warps=4": lambda: compile_hybrid(False),
          "hybrid tile block_n=64 warps=8": lambda: compile_hybrid(False, 64, 8),  # TritonBackend's tiles
          "hybrid block tile=16 warps=1": lambda: compile_hybrid(True, 16, 1),
          "hybrid block tile=16 warps=1 G=1": lambda: compile_hybrid(True, 16, 1, 1),
          "hybrid block tile=16 warps=1 bias": lambda: compile_hybrid(True, 16, 1, 4, True)}


def resources(cubin_path: str) -> str:
    """'REG:n ... SHARED:n' from cuobjdump, or '' where the tool is missing."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return ""
    out = subprocess.run([tool, "-res-usage", cubin_path], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
    return f"regs {m.group(1)} stack {m.group(2)}" if m else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="", help="keep the cubins here (default: a temporary folder)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("compile_sm90: unset TRITON_INTERPRET (the kernels would be interpreted functions)")
    import tempfile
    out = args.out or tempfile.mkdtemp()
    os.makedirs(out, exist_ok=True)
    failed = 0
    for v in VARIANTS:
        name = "decode bits={} block_n={} warps={} lazy_tau={} min_rows={}".format(*v)
        try:
            cubin = compile_decode(*v)
        except Exception as e:  # report every variant, then fail
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        path = os.path.join(out, "decode_{}_{}_{}_{}_{}.cubin".format(*v))
        with open(path, "wb") as f:
            f.write(cubin)
        print(f"ok {name}: {len(cubin)} bytes {resources(path)}", flush=True)
    for name, build in OTHERS.items():
        try:
            cubin = build()
        except Exception as e:  # reported, then the run fails
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        path = os.path.join(out, re.sub(r"\W+", "_", name) + ".cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        print(f"ok {name}: {len(cubin)} bytes {resources(path)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
