"""HF model folders: config.json (+ generation_config.json) and *.safetensors, sharded or not.

Weights are read only from safetensors: pickle checkpoints (.bin/.pt) can run arbitrary code
when loaded, so a folder that has nothing else is refused with a clear error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from nanokv.compute_service.model.config import ModelConfig
from nanokv.errors import NanoKVError
from nanokv.model_files import PICKLE_SUFFIXES  # noqa: F401 (re-exported)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise NanoKVError("model", f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise NanoKVError("model", f"{path} must hold a JSON object")
    return data


def hf_model_config(folder: str) -> ModelConfig:
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise NanoKVError("model", f"{folder} has no config.json (expected an HF model folder)")
    gen_path = os.path.join(folder, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else None
    try:
        return ModelConfig.from_hf_dict(_read_json(cfg_path), gen)
    except KeyError as e:
        raise NanoKVError("model", f"{cfg_path} lacks required key {e}") from None


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint's safetensors files (from the shard index when there is one)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        files = [os.path.join(folder, s) for s in shards]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise NanoKVError("model", f"shard index names missing files: {absent[:3]}")
    else:
        files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    if files:
        return files
    pickles = [f for f in os.listdir(folder) if f.endswith(PICKLE_SUFFIXES)]
    if pickles:
        names = ", ".join(sorted(pickles)[:3])
        raise NanoKVError("model", f"{folder} holds only pickle checkpoints ({names}); "
                          "nanokv loads weights only from .safetensors or .gguf (pickle files can run code). "
                          "Convert them with safetensors first.")
    raise NanoKVError("model", f"{folder} holds no .safetensors weights")


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time from memory-mapped files (CPU)."""
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def read_hf_folder(folder: str) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    cfg = hf_model_config(folder)
    return cfg, iter_safetensors(safetensors_files(folder))
