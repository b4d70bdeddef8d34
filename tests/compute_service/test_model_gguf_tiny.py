"""Tiny GGUF files written the way llama.cpp's converter writes them (llama: q/k rows permuted
for its rope kernel; qwen3: not) load back to the original weights and match HF's GGUF loading."""

from __future__ import annotations

import os
import re

import gguf
import numpy as np
import pytest
import torch

from nanokv.compute_service.model.config import ModelConfig
from nanokv.compute_service.model.loader import load_model, random_state_dict

# llama.cpp tensor names, written out independently of nanokv's mapping
_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def _gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
    assert m, name
    return f"blk.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's permutation: per head, interleave the two rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: str, cfg: ModelConfig, sd: dict[str, torch.Tensor], quant: bool,
               extra: dict[str, np.ndarray] | None = None) -> None:
    arch = cfg.architecture
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    else:
        w.add_rope_dimension_count(cfg.head_dim)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in sd.items():
        a = t.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            a = _llamacpp_permute(a, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            a = _llamacpp_permute(a, cfg.num_key_value_heads)
        if quant and a.ndim == 2 and "embed" not in name:
            qt = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(a, qt), raw_dtype=qt)
        elif quant and a.ndim == 2:
            w.add_tensor(_gguf_name(name), a.astype(np.float16))
        else:
            w.add_tensor(_gguf_name(name), a)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _config(arch: str) -> ModelConfig:
    # tiny-llama's llama3 rope cannot be expressed in GGUF metadata (llama.cpp ships a
    # rope_freqs tensor instead), so use plain rope here
    base = ModelConfig.preset("tiny-qwen3" if arch == "qwen3" else "tiny-llama")
    base.rope_scaling = None
    base.max_position_embeddings = 256
    return base.validate()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_f32_gguf_round_trips_exactly(arch, tmp_path):
    cfg = _config(arch)
    sd = random_state_dict(cfg, seed=7)
    path = str(tmp_path / "m.gguf")
    write_gguf(path, cfg, sd, quant=False)
    model, cfg2 = load_model(path, "float32", "cpu")
    assert (cfg2.architecture, cfg2.head_dim, cfg2.qk_norm) == (arch, cfg.head_dim, arch == "qwen3")
    assert cfg2.tie_word_embeddings == cfg.tie_word_embeddings
    p = dict(model.named_parameters())
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        qkv = p[f"model.layers.{i}.self_attn.qkv_proj.weight"]
        ref = torch.cat([sd[f"model.layers.{i}.self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(qkv, ref), "q/k permutation not undone exactly"
        assert qkv.shape[0] == q + 2 * kv
    assert torch.equal(p["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_quantized_gguf_matches_hf(arch, tmp_path):
    from helpers_model import PagedRunner
    from transformers import AutoModelForCausalLM

    cfg = _config(arch)
    path = str(tmp_path / "m.gguf")
    write_gguf(path, cfg, random_state_dict(cfg, seed=8), quant=True)
    ours, _ = load_model(path, "float32", "cpu")
    # HF's qwen3 GGUF config mapping ignores attention.key_length (its head_dim defaults to 128),
    # so tell it the head_dim
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32, head_dim=cfg.head_dim).eval()
    ids = list(range(3, 40))
    logits = PagedRunner(ours, num_blocks=8, block_size=16).step(ids, 0, True)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (logits - ref).abs().max().item() < 1e-4


def test_llama3_rope_freqs_tensor(tmp_path):
    """llama.cpp ships llama3 rope scaling as a rope_freqs tensor (per-pair divisors); loading it
    must give the same model as the HF-style llama3 rope_scaling config."""
    from helpers_model import PagedRunner

    from nanokv.compute_service.model.layers.rotary import rope_inv_freq
    from nanokv.compute_service.model.loader import random_model

    cfg = ModelConfig.preset("tiny-llama")  # llama3 rope scaling
    plain = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
    factors = (plain / rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)).numpy()
    assert factors.max() > 7.9  # the test is meaningless unless some pairs are scaled
    path = str(tmp_path / "m.gguf")
    gguf_cfg = ModelConfig.preset("tiny-llama")
    gguf_cfg.rope_scaling = None
    write_gguf(path, gguf_cfg, random_state_dict(cfg, seed=9), quant=False,
               extra={"rope_freqs.weight": factors})
    ours, cfg2 = load_model(path, "float32", "cpu")
    assert cfg2.rope_scaling is not None and cfg2.rope_scaling["rope_type"] == "freq_factors"
    ref, _ = random_model(cfg, "float32", "cpu", seed=9)
    ids = list(range(10, 50))
    a = PagedRunner(ours, num_blocks=8, block_size=16).step(ids, 0, True)
    b = PagedRunner(ref, num_blocks=8, block_size=16).step(ids, 0, True)
    assert (a - b).abs().max().item() < 1e-5
