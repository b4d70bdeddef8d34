"""The embedded SmolLM2-135M-Instruct GGUF through our loader and the paged cache matches HF
transformers' own GGUF loading (logits and greedy tokens)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers_model import PagedRunner

from nanokv.compute_service.model.loader import embedded_model_path, load_model, load_tokenizer

pytestmark = pytest.mark.slow  # ~30 s: two GGUF dequantizations and a tokenizer conversion


@pytest.fixture(scope="module")
def models(hf_model):
    """(ours, its config, HF's GGUF load from conftest's session fixture, chat-templated prompt)."""
    assert os.path.isfile(embedded_model_path())
    ours, cfg = load_model(None, torch.float32, "cpu")
    tok = load_tokenizer(None)
    hf = hf_model
    msgs = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # BatchEncoding in newer transformers
        ids = list(ids["input_ids"])
    return ours, cfg, hf, ids


def test_config_from_gguf(models):
    _, cfg, hf, _ = models
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [2]
    assert cfg.vocab_size == hf.config.vocab_size
    assert cfg.rope_theta == pytest.approx(100000.0)


def test_prefill_logits_match_hf(models):
    ours, _, hf, ids = models
    logits = PagedRunner(ours, num_blocks=16, block_size=16).step(ids, 0, True)  # [T, V]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    assert (logits - ref).abs().max().item() < 1e-3


def test_greedy_32_tokens_match_hf_generate(models):
    ours, _, hf, ids = models
    got = PagedRunner(ours, num_blocks=16, block_size=16, seed=1).greedy(ids, 32, eos={2})
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)[0, len(ids):].tolist()
    assert len(got) == 32
    assert got == ref


def test_chunked_prefill_equals_one_shot(models):
    """Prefill in three chunks (the second one crossing block boundaries) gives the same logits."""
    ours, _, _, ids = models
    one = PagedRunner(ours, num_blocks=16, block_size=16).step(ids, 0, True)
    r = PagedRunner(ours, num_blocks=16, block_size=16, seed=3)
    cuts = [0, 5, 29, len(ids)]
    parts = [r.step(ids[a:b], a, True) for a, b in zip(cuts, cuts[1:])]
    assert (torch.cat(parts) - one).abs().max().item() < 1e-3  # fp32 summation order only
