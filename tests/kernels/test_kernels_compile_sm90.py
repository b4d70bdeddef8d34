"""The decode kernels compile for an H100/H200 (sm_90) through Triton's real compiler, on the CPU.

The interpreter (TRITON_INTERPRET=1, the other kernel tests) runs the Python semantics only; typing
rules of the compiler (a loop-carried variable changing type, one return type per jit function,
dot operand shapes) are checked here (nanokv_tools.bench.compile_sm90, in a process without
TRITON_INTERPRET) and on the GPU. Triton's wheel ships ptxas: no GPU needed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")


def test_decode_kernels_compile_for_sm90(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # a fresh compile, not a cached one
    r = subprocess.run([sys.executable, "-m", "nanokv_tools.bench.compile_sm90", "--out", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ok ")]
    assert len(lines) == len(r.stdout.splitlines()), r.stdout  # every variant built, none FAILed
    for kind in ("bits=16", "bits=8", "bits=4", "min_rows=-1", "rope rot=False", "rope rot=True",
                 "norm add=False", "norm add=True", "silu_mul", "rope rot=True tokens=4", "prefill bits=4",
                 "prefill bits=16", "int4 fill", "int4 fill recip", "hybrid tile", "hybrid block",
                 "demote"):  # each kernel
        assert any(kind in ln for ln in lines), (kind, r.stdout)
    assert all(int(ln.split(": ")[1].split()[0]) > 10_000 for ln in lines)  # real cubins


@pytest.mark.skipif(not shutil.which("nvcc"), reason="no nvcc on this machine")
@pytest.mark.parametrize("defs,max_regs", [("G=2 NKV=8 BS=16 Q_BF16=0 ST_BF16=1 OUT_BF16=1 NSTAGE=2", 128),
                                           ("G=2 NKV=8 BS=32 Q_BF16=0 ST_BF16=1 OUT_BF16=1 NSTAGE=3", 128),
                                           ("G=3 NKV=3 BS=16 Q_BF16=1 ST_BF16=0 OUT_BF16=0 NSTAGE=4 MAXNREG=96", 96),
                                           ("G=2 NKV=8 BS=32 NT=2 Q_BF16=1 ST_BF16=1 OUT_BF16=1 NSTAGE=2", 168),
                                           ("G=4 NKV=4 BS=64 NT=2 Q_BF16=0 ST_BF16=0 OUT_BF16=0 NSTAGE=2 MAXNREG=128",
                                            128)])
def test_cuda_int4_decode_compiles_for_sm90(tmp_path, defs: str, max_regs: int) -> None:
    """The CUDA C++ int4 decode (kernels/cuda/decode_int4.cu) has no interpreter; here nvcc
    builds the source NVRTC gets for sm_90, and its resource report must show no spills, no stack
    frame and at most max_regs registers: 128 for one tile per loop step (16 one-warp programs per
    SM), 168 for two (12 per SM), or the cap asked for."""
    from nanokv.kernels.cuda_decode_int4 import source
    src = tmp_path / "decode_int4.cu"  # as NVRTC gets it: the .cuh files inlined
    src.write_text(source())
    assert '#include "' not in src.read_text()
    r = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "k.cubin"), "-Xptxas", "-v",
                        *[f"-D{d}" for d in defs.split()], str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = r.stderr
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
    regs = int(report.split("Used ")[1].split(" registers")[0])
    assert regs <= max_regs, report


def test_cuda_int4_decode_falls_back_when_it_cannot_be_built(monkeypatch) -> None:
    """A failed NVRTC build (no library, a rejected source, a changed torch hook) turns the CUDA
    kernel off for the process instead of failing the decode: the Triton kernels serve."""
    import torch

    from nanokv.kernels import cuda_decode_int4 as cd

    def broken(*args, **kwargs):
        raise RuntimeError("nvrtc: library not found")

    monkeypatch.setattr(torch.cuda, "_compile_kernel", broken, raising=False)
    monkeypatch.setattr(cd, "_BROKEN", [])
    assert cd._kernel.__wrapped__(2, 8, 16, False, True, True, 0, 2) is None
    assert cd._BROKEN == ["nvrtc: library not found"]
