"""The decode kernels compile for an H100/H200 (sm_90) through Triton's real compiler, on the CPU.

The interpreter (TRITON_INTERPRET=1, the other kernel tests) runs the Python semantics only; typing
rules of the compiler (a loop-carried variable changing type, one return type per jit function,
dot operand shapes) are checked here (nanokv.bench.compile_sm90, in a process without
TRITON_INTERPRET) and on the GPU. Triton's wheel ships ptxas: no GPU needed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")


def test_decode_kernels_compile_for_sm90(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # a fresh compile, not a cached one
    r = subprocess.run([sys.executable, "-m", "nanokv.bench.compile_sm90", "--out", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ok ")]
    assert len(lines) == len(r.stdout.splitlines()), r.stdout  # every variant built, none FAILed
    for kind in ("bits=16", "bits=8", "bits=4", "min_rows=-1", "rope rot=False", "rope rot=True",
                 "norm add=False", "norm add=True", "silu_mul"):  # each kernel
        assert any(kind in ln for ln in lines), (kind, r.stdout)
    assert all(int(ln.split(": ")[1].split()[0]) > 10_000 for ln in lines)  # real cubins
