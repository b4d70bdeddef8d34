"""Bad model paths and checkpoints fail with NanoKVError naming the problem."""

from __future__ import annotations

import json
import os

import pytest
import torch

from nanokv.compute_service.model.config import ModelConfig
from nanokv.compute_service.model.loader import (
    build_model,
    load_model,
    random_state_dict,
    resolve_model_path,
    save_hf_folder,
)
from nanokv.errors import NanoKVError


def test_missing_path():
    with pytest.raises(NanoKVError, match="does not exist") as e:
        load_model("/nonexistent/model-dir", "float32", "cpu")
    assert e.value.field == "model"


def test_bin_only_folder_refused(tmp_path):
    cfg = ModelConfig.preset("tiny-llama")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(NanoKVError, match="safetensors"):
        load_model(str(tmp_path), "float32", "cpu")


def test_pickle_file_refused(tmp_path):
    f = tmp_path / "model.pt"
    f.write_bytes(b"x")
    with pytest.raises(NanoKVError, match="pickle"):
        load_model(str(f), "float32", "cpu")


def test_unknown_architecture_names_supported_list(tmp_path):
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NanoKVError, match="LlamaForCausalLM") as e:
        load_model(str(tmp_path), "float32", "cpu")
    assert e.value.field == "architecture" and "Qwen3ForCausalLM" in str(e.value)


def test_unknown_gguf_architecture(tmp_path):
    import gguf

    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(NanoKVError, match="llama, qwen2, qwen3"):
        load_model(path, "float32", "cpu")


def test_missing_tensor_and_bad_shape(tmp_path):
    cfg = ModelConfig.preset("tiny-qwen3")
    sd = random_state_dict(cfg)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_hf_folder(cfg, sd, str(tmp_path / "a"))
    with pytest.raises(NanoKVError, match="gate_up_proj"):
        load_model(str(tmp_path / "a"), "float32", "cpu")
    sd = random_state_dict(cfg)
    sd["model.norm.weight"] = torch.ones(3)
    save_hf_folder(cfg, sd, str(tmp_path / "b"))
    with pytest.raises(NanoKVError, match="shape"):
        load_model(str(tmp_path / "b"), "float32", "cpu")


def test_folder_without_tokenizer(tmp_path):
    from nanokv.compute_service.model.loader import load_tokenizer

    save_hf_folder(ModelConfig.preset("tiny-llama"), {}, str(tmp_path))
    with pytest.raises(NanoKVError, match="tokenizer"):
        load_tokenizer(str(tmp_path))


def test_folder_without_config_or_gguf(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(NanoKVError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_bad_dtype_and_preset():
    with pytest.raises(NanoKVError) as e:
        build_model(ModelConfig.preset("tiny-llama"), dtype="float64")
    assert e.value.field == "dtype"
    with pytest.raises(NanoKVError, match="tiny-qwen3"):
        ModelConfig.preset("nope")


def test_tp_size_must_fit_heads():
    cfg = ModelConfig.preset("tiny-qwen3")  # 6 q heads, 2 kv heads, MLP width 160
    build_model(cfg, tp_rank=1, tp_size=4)  # heads may split unevenly
    with pytest.raises(NanoKVError, match="7 is more than num_attention_heads 6"):
        build_model(cfg, tp_size=7)
    with pytest.raises(NanoKVError, match="3 does not divide merged output features"):
        build_model(cfg, tp_rank=0, tp_size=3)  # the heads would split, the MLP must split evenly


def test_unsupported_rope_and_activation():
    base = ModelConfig.preset("tiny-llama").to_hf_dict()
    with pytest.raises(NanoKVError, match="yarn") as e:
        ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    assert e.value.field == "rope_scaling"
    with pytest.raises(NanoKVError) as e:
        ModelConfig.from_hf_dict({**base, "hidden_act": "gelu"})
    assert e.value.field == "hidden_act"


def test_sharded_index_with_missing_shard(tmp_path):
    cfg = ModelConfig.preset("tiny-llama")
    save_hf_folder(cfg, random_state_dict(cfg), str(tmp_path))
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(NanoKVError, match="missing files"):
        load_model(str(tmp_path), "float32", "cpu")
    assert os.path.isfile(tmp_path / "model.safetensors")
