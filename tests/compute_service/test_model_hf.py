"""Tiny random HF models (Qwen3, Llama w/ llama3 rope + bias, Qwen2, Mistral) saved as sharded
safetensors load through our HF loader and match HF logits and greedy tokens."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers_model import PagedRunner

from nanokv.compute_service.model.config import ModelConfig
from nanokv.compute_service.model.loader import load_model, random_state_dict, save_hf_folder

COMMON = dict(vocab_size=1003, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              max_position_embeddings=512, rms_norm_eps=1e-6)


def _hf_config(family: str):
    import transformers as tf

    if family == "qwen3":  # 6 q heads over 2 kv heads; heads * head_dim (96) != hidden (64)
        return tf.Qwen3Config(**COMMON, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                              tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                         "rope_theta": 1e6})
    if family == "llama":  # llama3 rope scaling, q/k/v/o biases, untied head
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return tf.LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1, attention_bias=True,
                              tie_word_embeddings=False, rope_parameters=rope)
    if family == "qwen2":  # q/k/v bias, no o bias
        return tf.Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                              tie_word_embeddings=True)
    return tf.MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            sliding_window=None, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2", "mistral"])
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_hf_config(request.param), dtype=torch.float32).eval()
    with torch.no_grad():  # HF inits norms at 1 and biases at 0: make them matter
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    folder = str(tmp_path_factory.mktemp(request.param))
    hf.save_pretrained(folder, max_shard_size="100KB")  # several shards + index
    ours, cfg = load_model(folder, torch.float32, "cpu")
    return request.param, hf, ours, cfg, folder


def test_sharded_safetensors_written(pair):
    *_, folder = pair
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))


def test_config_parsed(pair):
    family, hf, _, cfg, _ = pair
    assert cfg.architecture == family
    assert cfg.head_dim == (getattr(hf.config, "head_dim", None) or 64 // hf.config.num_attention_heads)
    assert cfg.qk_norm == (family == "qwen3")
    assert cfg.attention_bias == (family in ("llama", "qwen2"))
    assert cfg.attention_out_bias == (family == "llama")
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    if family == "llama":
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"


def test_logits_match(pair):
    _, hf, ours, _, _ = pair
    ids = torch.randint(0, 1003, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = PagedRunner(ours, num_blocks=16, block_size=16).step(ids, 0, True)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (logits - ref).abs().max().item() < 1e-4


def test_greedy_16_tokens_match(pair):
    _, hf, ours, _, _ = pair
    ids = torch.randint(0, 1003, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    got = PagedRunner(ours, num_blocks=16, block_size=16, seed=5).greedy(ids, 16)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
    assert got == ref[0, len(ids):].tolist()


def test_no_metadata_path_matches_paged(pair):
    """Warm-up/profiling path (metadata None: plain causal SDPA) computes the same thing."""
    from nanokv.kv.metadata import forward_context

    _, _, ours, _, _ = pair
    ids = list(range(3, 30))
    paged = PagedRunner(ours, num_blocks=8, block_size=16).step(ids, 0, True)
    with torch.inference_mode(), forward_context(None, []):
        plain = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids))))
    assert (paged - plain).abs().max().item() < 1e-4


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_save_hf_folder_round_trip(preset, tmp_path):
    """Our random weights written by save_hf_folder read back identically by us and by HF."""
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig.preset(preset)
    folder = save_hf_folder(cfg, random_state_dict(cfg, seed=3), str(tmp_path))
    ours, cfg2 = load_model(folder, "float32", "cpu")
    assert cfg2 == cfg
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = list(range(5, 45))
    logits = PagedRunner(ours, num_blocks=8, block_size=16).step(ids, 0, True)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (logits - ref).abs().max().item() < 1e-4
    assert json.load(open(os.path.join(folder, "config.json")))["architectures"][0].endswith("ForCausalLM")
