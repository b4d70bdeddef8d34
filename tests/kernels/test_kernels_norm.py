"""RMSNorm (+ residual) and SiLU-and-mul Triton kernels (nanokv.kernels.triton_norm) against the torch
functions of nanokv.compute_service.model.layers.fusion (CPU: TRITON_INTERPRET=1), and the dispatch that picks them."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
pytest.importorskip("triton")

from nanokv.compute_service.model.layers import fusion  # noqa: E402
from nanokv.kernels import triton_norm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter converts fp32 to bf16 by truncation, the GPU rounds to nearest as torch does
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def _tol(dtype: torch.dtype) -> dict:
    # fp32: reduction order; 16-bit: a rounding may go the other way (one ulp)
    return {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.float16: {"rtol": 2e-3, "atol": 2e-3},
            torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2}}[dtype]


def _rows(t: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(t, n + 24, generator=g) * 3  # a strided view, as a slice of a wider output
    return wide.to(dtype).to(DEV)[:, :n]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 100])
def test_rms_norm_kernel_matches_the_torch_function(dtype, n) -> None:
    x, r = _rows(7, n, dtype, 1), _rows(7, n, dtype, 2)
    w = (torch.rand(n, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype).to(DEV)
    out = triton_norm.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, fusion._rms(x, w, 1e-6), **_tol(dtype))
    out2, s = triton_norm.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, x + r)  # one rounding of the sum, as torch's
    torch.testing.assert_close(out2, fusion._rms(x + r, w, 1e-6), **_tol(dtype))
    assert not torch.allclose(out2.float(), fusion._rms(x, w, 1e-6).float(), rtol=1e-2, atol=1e-2)
    assert out.shape == x.shape and out.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("i", [96, 1500])
def test_silu_mul_kernel_matches_the_torch_function(dtype, i) -> None:
    x = _rows(5, 2 * i, dtype, 4)
    out = triton_norm.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, **_tol(dtype))
    assert out.shape == (5, i)


def test_empty_batches_and_unsupported_layouts() -> None:
    w = torch.ones(64, device=DEV)
    assert triton_norm.rms_norm(torch.empty(0, 64, device=DEV), w, 1e-6).shape == (0, 64)
    assert triton_norm.silu_mul(torch.empty(0, 128, device=DEV)).shape == (0, 64)
    assert not triton_norm.supported(torch.ones(2, 64, dtype=torch.float16, device=DEV), w)  # mixed dtypes
    assert triton_norm.supported(torch.ones(2, 64, device=DEV), w)


@pytest.mark.skipif(DEV == "cpu", reason="the fused paths run on CUDA tensors only")
def test_fusion_dispatch_uses_the_kernels_on_a_gpu(monkeypatch) -> None:
    calls: list[str] = []
    for name in ("rms_norm", "add_rms_norm", "silu_mul"):
        fn = getattr(triton_norm, name)
        monkeypatch.setattr(triton_norm, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    x = torch.randn(3, 64, device=DEV)
    w = torch.ones(64, device=DEV)
    try:
        fusion.set_fusion(True)
        fusion.rms_norm(x, w, 1e-6)
        fusion.add_rms_norm(x, x, w, 1e-6)
        fusion.silu_mul(x)
    finally:
        fusion.set_fusion(False)
    assert calls == ["rms_norm", "add_rms_norm", "silu_mul"]
