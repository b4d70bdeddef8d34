"""weight_quantization="gguf": the embedded GGUF's 4-bit matrices kept packed on the CPU (layers/qlinear.py).

Checked on the real file: the unpacked blocks equal gguf's own dequantization, the packed product
equals the fp32 product within bf16's rounding, every loaded layer (q/k rows un-permuted, fused
shards placed) multiplies like the full-precision model's, and greedy decoding is reproducible
and independent of what shares the batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanokv.compute_service.model.gguf_loader import _reader
from nanokv.compute_service.model.layers.linear import LinearBase
from nanokv.compute_service.model.layers.qlinear import Int4Linear, Int4LMHead, Q4Rows
from nanokv.compute_service.model.loader import embedded_model_path, load_model, resolve_weight_quantization
from nanokv.config import EngineConfig
from nanokv.errors import ConfigError, NanoKVError
from nanokv.gateway.llm import LLM
from nanokv.sampling import SamplingParams

# measured on these tensors: 0.25-0.32 % (bf16 activations, outputs and scales); fp32 vs itself is 0
REL_TOL = 6e-3


def _tensor(name: str):
    return next(t for t in _reader(embedded_model_path()).tensors if t.name == name)


def _gguf_fp32(t) -> torch.Tensor:
    from gguf.quants import dequantize

    rows, cols = (int(n) for n in reversed(t.shape.tolist()))
    return torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(rows, cols))


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).norm() / ref.norm())


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "token_embd.weight"])
def test_packed_product_matches_dequantized_fp32(name):
    t = _tensor(name)
    w = _gguf_fp32(t)
    rows, cols = w.shape
    if t.tensor_type.name == "Q8_0":  # the tied LM head: nibble split along a doubled `in`
        lin = Int4Linear.from_q8_0(t.data, rows, cols)
    else:
        q4 = Q4Rows.from_blocks(t.data, t.tensor_type.name, rows, cols)
        assert torch.equal(q4.dequantize(), w)  # the unpacked blocks are gguf's numbers exactly
        lin = Int4Linear.from_q4(q4)
    x = torch.randn(300, cols, generator=torch.Generator().manual_seed(0))
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (300, rows)
    assert _rel(y, F.linear(x, w)) < REL_TOL
    # each row's bits do not depend on the other rows or the thread count (batch invariance for free)
    for m in (1, 7, 64):
        assert torch.equal(lin(x[:m]), y[:m])
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(lin(x[:5]), y[:5])
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models():
    full, _ = load_model(None, "float32", "cpu", weight_quantization="none")
    packed, _ = load_model(None, "float32", "cpu", weight_quantization="gguf")
    return full, packed


def test_every_loaded_layer_multiplies_like_the_full_precision_model(models):
    full, packed = models
    fl = dict((n, m) for n, m in full.named_modules() if isinstance(m, LinearBase))
    pl = dict((n, m) for n, m in packed.named_modules() if isinstance(m, LinearBase))
    assert len(pl) == 120 and all(m.qlinear is not None for m in pl.values())  # 30 x (qkv, o, gate_up, down)
    assert all(m.qlinear is None for m in fl.values())
    g = torch.Generator().manual_seed(1)
    for name, m in pl.items():  # q/k rows un-permuted, q|k|v and gate|up shards in place
        x = torch.randn(4, fl[name].weight.shape[1], generator=g)
        assert _rel(m(x), fl[name](x)) < REL_TOL, name
    assert isinstance(packed.lm_head, Int4LMHead)
    h = torch.randn(3, 576, generator=g)
    exact, approx = full.compute_logits(h), packed.compute_logits(h)
    assert _rel(approx, exact) < REL_TOL
    # the top logits are re-scored in fp32: the argmax is the fp32 product's
    assert torch.equal(approx.argmax(-1), exact.argmax(-1))
    top = exact.topk(5, dim=-1).indices
    assert torch.allclose(approx.gather(-1, top), exact.gather(-1, top), rtol=1e-5, atol=1e-4)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["Who wrote Romeo and Juliet?", "Write a haiku about the sea.", "List three prime numbers."]


def test_gguf_greedy_is_reproducible_and_batch_independent():
    # batch_invariant: every row on the int4 product (row results independent of the batch) and the
    # invariant CPU attention. Without it, prefill's fp32 sgemm bits depend on the chunk's rows and
    # bf16 rounding can amplify them into another token (1 of these 3 prompts, at token 17)
    llm = LLM(weight_quantization="gguf", batch_invariant=True, num_gpu_blocks=256, block_size=16)
    ids = [llm.engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    together = [o.token_ids for o in llm.generate(ids, GREEDY, use_tqdm=False)]
    again = [o.token_ids for o in llm.generate(ids, GREEDY, use_tqdm=False)]
    alone = [llm.generate([i], GREEDY, use_tqdm=False)[0].token_ids for i in ids]
    assert together == again == alone
    text = llm.tokenizer.decode(together[0])
    assert "Shakespeare" in text, text
    # close to the full-precision engine: same weights, bf16 rounding of the activations only
    ref = [o.token_ids for o in LLM(weight_quantization="none", num_gpu_blocks=256, block_size=16)
           .generate(ids, GREEDY, use_tqdm=False)]
    assert sum(a[:8] == b[:8] for a, b in zip(together, ref)) >= 2


def test_bad_and_inapplicable_values_name_the_field():
    with pytest.raises(ConfigError, match="weight_quantization"):
        EngineConfig.from_kwargs(weight_quantization="int4")
    for kind, dev, tp in (("hf", "cpu", 1), ("gguf", "cuda", 1), ("gguf", "cpu", 2)):
        with pytest.raises(NanoKVError, match="weight_quantization"):
            resolve_weight_quantization("gguf", kind, dev, tp)
        assert resolve_weight_quantization("auto", kind, dev, tp) == "none"
    assert resolve_weight_quantization("auto", "gguf", "cpu", 1) == "gguf"
    assert EngineConfig().weight_quantization == "none"  # the default: greedy equal to HF (docs/cpu-decode.md)
