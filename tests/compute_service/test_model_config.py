"""ModelConfig from real-world HF config.json dialects (transformers 4 and 5), presets, RoPE tables."""

from __future__ import annotations

import pytest
import torch

from nanokv.compute_service.model.config import ModelConfig
from nanokv.compute_service.model.layers.rotary import rope_inv_freq

LLAMA31_V4 = {  # Llama-3.1-8B-Instruct's config.json (transformers 4 dialect)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 128256,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
QWEN25 = {  # Qwen2.5-0.5B-Instruct
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 151936,
    "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True,
    "bos_token_id": 151643, "eos_token_id": 151645,
}


def test_llama31_v4_config():
    cfg = ModelConfig.from_hf_dict(LLAMA31_V4, {"eos_token_id": [128001, 128009]})
    assert cfg.architecture == "llama" and cfg.head_dim == 128
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is not None
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    assert cfg.eos_token_ids == [128001, 128008, 128009]
    assert not cfg.attention_bias and not cfg.qk_norm


def test_qwen25_config_has_qkv_bias_and_no_window():
    cfg = ModelConfig.from_hf_dict(QWEN25)
    assert (cfg.architecture, cfg.head_dim) == ("qwen2", 64)
    assert cfg.attention_bias and not cfg.attention_out_bias
    assert cfg.sliding_window is None and cfg.tie_word_embeddings and cfg.eos_token_ids == [151645]


def test_legacy_type_key_and_default_rope():
    d = {**LLAMA31_V4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert ModelConfig.from_hf_dict(d).rope_scaling == {"rope_type": "linear", "factor": 2.0}
    d = {**LLAMA31_V4, "rope_scaling": None}
    assert ModelConfig.from_hf_dict(d).rope_scaling is None


def test_qwen3_preset_is_the_real_architecture():
    cfg = ModelConfig.preset("qwen3-0.6b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        1024, 28, 16, 8)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (128, 3072, 151936)
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.rope_theta == 1e6
    assert cfg.heads_per_rank(2) == (8, 4) and cfg.heads_per_rank(16) == (1, 1)


@pytest.mark.parametrize("name", ModelConfig.preset_names())
def test_presets_round_trip_through_hf_dict(name):
    cfg = ModelConfig.preset(name)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    cfg.eos_token_ids.append(99)  # presets hand out copies
    assert 99 not in ModelConfig.preset(name).eos_token_ids


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_inv_freq_matches_hf(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}
    hf_cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                         rope_parameters=rope)
    if scaling is None:
        ref = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
    ours = rope_inv_freq(128, 500000.0, scaling)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
