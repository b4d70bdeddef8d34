"""The compiled form of the RoPE fusion (nanokv.model.layers.fusion), compiled here on the CPU: the
engine compiles it on a GPU only, where q and k come back as adjacent views of one buffer in the
attention's dtype, so the KV format's key rotation is one GEMM (nanokv.kv.rotation.joint_view)."""

from __future__ import annotations

import torch

from nanokv.kv.rotation import joint_view, maybe_rotate, rotation_matrix
from nanokv.model.layers import fusion


def test_compiled_qk_norm_rope_returns_one_buffer_in_the_asked_dtype() -> None:
    g = torch.Generator().manual_seed(0)
    T, Hq, Hk, D = 5, 4, 2, 32
    q = torch.randn(T, Hq, D, generator=g).bfloat16()
    k = torch.randn(T, Hk, D, generator=g).bfloat16()
    qw, kw = torch.rand(D, generator=g).bfloat16() + 0.5, torch.rand(D, generator=g).bfloat16() + 0.5
    ang = torch.rand(T, 1, D // 2, generator=g)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    fn = fusion.qk_norm_rope.__wrapped__  # type: ignore[attr-defined]
    eq, ek = fn(q, k, qw, kw, 1e-6, cos, sin, torch.float16)  # as written: two tensors, cast
    assert eq.dtype == ek.dtype == torch.float16 and joint_view(eq, ek) is None
    cq, ck = torch.compile(fn, fullgraph=True)(q, k, qw, kw, 1e-6, cos, sin, torch.float16)
    assert cq.dtype == ck.dtype == torch.float16
    assert joint_view(cq, ck) is not None  # one buffer: q's heads, then k's
    # the same function (compiled code rounds once, eager after each bf16 op)
    assert torch.allclose(cq.float(), eq.float(), atol=0.05) and torch.allclose(ck.float(), ek.float(), atol=0.05)
    rq, rk = maybe_rotate(cq, ck, 8)  # one product over both
    assert joint_view(rq, rk) is not None
    r = rotation_matrix(D, torch.float16)
    assert torch.allclose(rq.float(), (cq @ r).float(), atol=1e-2)
    assert torch.allclose(rk.float(), (ck @ r).float(), atol=1e-2)
