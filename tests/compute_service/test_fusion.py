"""q's and k's norm + RoPE as one tensor (nanokv.compute_service.model.layers.fusion): the torch reference against
q and k done apart, and the GPU's one-kernel form (nanokv.kernels.triton_rope, here under
TRITON_INTERPRET=1) against the torch function with the compiled path's roundings; its output keeps
q's and k's heads adjacent, so the KV format's key rotation is one GEMM (nanokv.kv.rotation)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
pytest.importorskip("triton")

from nanokv.compute_service.model.layers import fusion  # noqa: E402
from nanokv.kernels import triton_rope  # noqa: E402
from nanokv.kv.rotation import joint_view, maybe_rotate, rotation_matrix  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(dtype: torch.dtype, hq: int = 4, hk: int = 2, d: int = 32, t: int = 5):
    g = torch.Generator().manual_seed(hq * 10 + d)
    # q's and k's heads as a strided view of a qkv-like row (v's heads after them)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)
    qk = qkv[:, :(hq + hk) * d].view(t, hq + hk, d)
    qw, kw = (torch.rand(d, generator=g) + 0.5).to(dtype), (torch.rand(d, generator=g) + 0.5).to(dtype)
    ang = torch.rand(t, d, generator=g) * 6
    cs = torch.cat((ang[:, :d // 2].cos(), ang[:, :d // 2].sin()), dim=-1).to(dtype).unsqueeze(1)
    cos, sin = cs.chunk(2, dim=-1)  # [t, 1, d/2] views, as RotaryEmbedding.cos_sin gives them
    return qk, qw, kw, cos, sin, hq


def _compiled_semantics(qk, qw, kw, eps, cos, sin, dtype, hq, norm=True):
    """The torch function with fp32 inside and roundings only where the kernel rounds."""
    x = qk.float()
    if norm:
        w = fusion._head_weight(qw, kw, hq, qk.shape[1]).float()
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        x = ((x * r).to(qk.dtype).float() * w).to(qk.dtype).float()
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.float(), sin.float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(dtype)


def test_joint_qk_norm_rope_equals_q_and_k_normed_and_rotated_apart() -> None:
    qk, qw, kw, cos, sin, hq = _inputs(torch.float32)
    out = fusion.qk_norm_rope(qk, qw, kw, 1e-6, cos, sin, torch.float32, hq)
    # each part with its own weight, as HF's q_norm / k_norm then apply_rotary_pos_emb
    q = fusion._rotate(fusion._rms(qk[:, :hq], qw, 1e-6), cos, sin)
    k = fusion._rotate(fusion._rms(qk[:, hq:], kw, 1e-6), cos, sin)
    assert out.shape == qk.shape
    assert torch.equal(out[:, :hq], q) and torch.equal(out[:, hq:], k)
    assert not torch.equal(out[:, hq:], fusion._rotate(fusion._rms(qk[:, hq:], qw, 1e-6), cos, sin))


# bf16 only on a GPU: the interpreter converts fp32 to bf16 by truncation (1.6761 -> 1.6719, not 1.6797)
_BF16 = pytest.mark.skipif(DEV == "cpu", reason="TRITON_INTERPRET rounds fp32 -> bf16 toward zero")


@pytest.mark.parametrize("dtype,out_dtype", [
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32),
    pytest.param(torch.bfloat16, torch.bfloat16, marks=_BF16),
    pytest.param(torch.bfloat16, torch.float16, marks=_BF16)])
@pytest.mark.parametrize("heads,d", [((4, 2), 32), ((3, 3), 64), ((2, 1), 24)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("many", [False, True])
def test_triton_qk_norm_rope_matches_torch(dtype, out_dtype, heads, d, norm, many, monkeypatch) -> None:
    """Odd head counts (a partial head tile), a head dim whose half is not a power of two; many:
    several tokens per program (long steps), 5 tokens so the last program is partly empty."""
    if many:
        monkeypatch.setattr(triton_rope, "MANY_TOKENS", 1)
    qk, qw, kw, cos, sin, hq = _inputs(dtype, *heads, d=d)
    want = _compiled_semantics(qk, qw, kw, 1e-6, cos, sin, out_dtype, hq, norm)
    got = triton_rope.qk_norm_rope(qk.to(DEV), cos.to(DEV), sin.to(DEV), out_dtype,
                                   (qw.to(DEV), kw.to(DEV), 1e-6, hq) if norm else None).cpu()
    assert got.dtype == out_dtype and got.shape == qk.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:  # an intermediate rounding may land one step apart (rsqrt, sum order): one ulp of the row
        assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
        assert (got != want).float().mean() < 0.05
    # and the plain torch function (rounding after each bf16 op) within the bf16 steps in between
    ref = (fusion.qk_norm_rope(qk, qw, kw, 1e-6, cos, sin, out_dtype, hq) if norm
           else fusion.rope(qk, cos, sin, out_dtype))
    assert torch.allclose(got.float(), ref.float(), atol=1e-5 if dtype == torch.float32 else 0.06)
    assert not torch.allclose(got.float(), qk.float(), atol=0.06)  # (it did rotate)


def test_triton_output_keeps_q_and_k_adjacent_for_one_rotation_product() -> None:
    qk, qw, kw, cos, sin, hq = _inputs(torch.float16)
    out = triton_rope.qk_norm_rope(qk.to(DEV), cos.to(DEV), sin.to(DEV), torch.float16,
                                   (qw.to(DEV), kw.to(DEV), 1e-6, hq)).cpu()
    q, k = out[:, :hq], out[:, hq:]
    assert joint_view(q, k) is not None  # q's heads, then k's, in one buffer
    rq, rk = maybe_rotate(q, k, 8)  # one product over both
    assert joint_view(rq, rk) is not None
    r = rotation_matrix(qk.shape[-1], torch.float16)
    assert torch.allclose(rq.float(), (q @ r).float(), atol=1e-2)
    assert torch.allclose(rk.float(), (k @ r).float(), atol=1e-2)


def test_bad_layout_is_an_error_naming_the_inputs() -> None:
    qk, _, _, cos, sin, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="contiguous last dim"):
        triton_rope.qk_norm_rope(qk.transpose(1, 2), cos, sin, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,d", [((4, 2), 32), ((3, 3), 64), ((2, 1), 48)])
@pytest.mark.parametrize("many", [False, True])
def test_triton_rope_applies_the_kv_rotation_as_its_gemm_would(dtype, heads, d, many, monkeypatch) -> None:
    """rot: the KV format's q/k rotation (Hadamard at 32 and 64, a QR matrix at 48) in the same
    kernel: as rounding the RoPE output to dtype and multiplying by R; head counts below the dot's
    16 rows, a half dim of 24; many: several tokens per program."""
    if many:
        monkeypatch.setattr(triton_rope, "MANY_TOKENS", 1)
    from nanokv.kv.rotation import rotation_matrix
    qk, qw, kw, cos, sin, hq = _inputs(dtype, *heads, d=d)
    r = rotation_matrix(d, dtype)
    plain = _compiled_semantics(qk, qw, kw, 1e-6, cos, sin, dtype, hq)
    want = (plain.float() @ r.float()).to(dtype)
    got = triton_rope.qk_norm_rope(qk.to(DEV), cos.to(DEV), sin.to(DEV), dtype, (qw.to(DEV), kw.to(DEV), 1e-6, hq),
                                   r.to(DEV)).cpu()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert not torch.allclose(got.float(), plain.float(), atol=0.05)  # (it did rotate)
    with pytest.raises(ValueError, match="rot must be"):
        triton_rope.qk_norm_rope(qk, cos, sin, dtype, rot=r[:, :-1])


@pytest.mark.parametrize("bits", [8, 4])
def test_engine_with_the_rotation_in_the_rope_kernel_stores_the_same_cache(monkeypatch, bits) -> None:
    """TritonConfig.qk_rotation_in_rope: the rotation moves from before_store into the RoPE step
    (CPU: its torch form; GPU: the Triton kernel, fp32); the int8/int4 cache the run leaves and the greedy
    tokens are the same, so the rotation ran exactly once. On the GPU the kernel's dot sums in
    another order than the rotation GEMM: a code may then round the other way (one step, rarely)."""
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams
    prompts = [[(5 * i + 3 + j) % 997 + 2 for i in range(20)] for j in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    toks, caches = {}, {}
    for flag in ("0", "1"):
        llm = LLM("random:tiny-llama", kernel_options=f"qk_rotation_in_rope={flag}", num_gpu_blocks=16, block_size=16,
                  max_num_batched_tokens=128, device=DEV, dtype="float32", attention_backend="triton",
                  enable_compression=True, quantization_bitwidth=bits)
        assert llm.engine.runner.backend.config.qk_rotation_in_rope == (flag == "1")
        toks[flag] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        caches[flag] = [(c.k.clone(), c.k_scale.clone()) for c in llm.engine.runner.kv_caches]
    assert toks["0"] == toks["1"]
    for (k0, s0), (k1, s1) in zip(caches["0"], caches["1"]):
        if DEV == "cpu":
            assert torch.equal(k0, k1) and torch.equal(s0, s1)
        else:
            if bits == 4:  # two codes per byte: compare nibbles
                k0, k1 = torch.cat((k0 & 15, k0 >> 4)), torch.cat((k1 & 15, k1 >> 4))
            step = (k0.int() - k1.int()).abs()
            assert int(step.max()) <= 1 and float((step > 0).float().mean()) < 1e-3
            torch.testing.assert_close(s0, s1, rtol=1e-3, atol=0)  # fp16 scales: one ulp at most
