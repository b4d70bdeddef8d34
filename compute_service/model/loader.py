"""Entry points: build a model from a GGUF file, an HF folder, the embedded SmolLM2, or random weights.

The model is built directly on its device and dtype with empty weights, then every checkpoint
tensor streams through `LlamaForCausalLM.load_weights`, whose weight_loaders copy out this TP
rank's shard; so one rank never materialises another rank's shards on the device.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from nanokv.compute_service.distributed import tp_state
from nanokv.compute_service.model.config import ModelConfig
from nanokv.compute_service.model.gguf_loader import read_gguf
from nanokv.compute_service.model.hf_loader import read_hf_folder
from nanokv.compute_service.model.llama import LlamaForCausalLM
from nanokv.errors import NanoKVError
from nanokv.model_files import _file_key, embedded_model_path, load_tokenizer, resolve_model_path

__all__ = ["embedded_model_path", "load_model", "load_tokenizer", "random_model", "resolve_model_path"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str) -> torch.dtype:
    """torch dtype or name ('auto' = float32 on CPU, bfloat16 on CUDA)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise NanoKVError("dtype", f"got {dtype!r}; allowed: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build_model(cfg: ModelConfig, dtype: torch.dtype | str = "float32", device: torch.device | str = "cpu",
                tp_rank: int = 0, tp_size: int = 1) -> LlamaForCausalLM:
    """An empty (uninitialised) model for one TP rank, allocated on `device` in `dtype`."""
    cfg.heads_per_rank(tp_size)  # clear error before any allocation
    with tp_state(tp_rank, tp_size), _default_dtype(resolve_dtype(dtype, device)), torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.eval()


# Loaded models and tokenizers, reused by later engines in the same process (tests and benchmarks
# build many engines on one model; weights are read-only, all per-engine state lives in the runner).
_MODELS: dict[tuple, tuple[LlamaForCausalLM, ModelConfig]] = {}
_CACHE_SIZE = 2


def load_model(path: str | None, dtype: torch.dtype | str = "auto", device: torch.device | str = "cpu",
               tp_rank: int = 0, tp_size: int = 1, weight_quantization: str = "none"
               ) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load a GGUF file, an HF folder (safetensors), or with `path=None` the embedded SmolLM2.
    weight_quantization (EngineConfig's): "gguf" keeps a GGUF file's 4-bit matrices packed (CPU,
    one rank; packed_weights), "none" dequantizes everything to `dtype`, "auto" = gguf where it applies."""
    kind, resolved = resolve_model_path(path)
    wq = resolve_weight_quantization(weight_quantization, kind, device, tp_size)
    key = (_file_key(resolved), str(dtype), str(device), tp_rank, tp_size, wq)
    if key in _MODELS:
        return _MODELS[key]
    cfg, weights = read_gguf(resolved, keep_q4=wq == "gguf") if kind == "gguf" else read_hf_folder(resolved)
    model = build_model(cfg, dtype, device, tp_rank, tp_size)
    with torch.no_grad():
        # (Q4Rows reach LinearBase's weight loaders in a tensor's place)
        model.load_weights(weights)  # type: ignore[arg-type]
        if wq == "gguf":
            from nanokv.compute_service.model.packed_weights import pack_gguf_weights

            pack_gguf_weights(model, resolved)
    if len(_MODELS) >= _CACHE_SIZE:
        _MODELS.pop(next(iter(_MODELS)))
    _MODELS[key] = (model, cfg)
    return model, cfg


def resolve_weight_quantization(mode: str, kind: str, device: torch.device | str, tp_size: int) -> str:
    """"none" or "gguf" for EngineConfig.weight_quantization's value on this model, device and TP size."""
    if mode not in ("auto", "none", "gguf"):
        raise NanoKVError("weight_quantization", f"got {mode!r}; allowed values: auto, none, gguf")
    dev = torch.device(device).type
    applies = kind == "gguf" and dev == "cpu" and tp_size == 1
    if mode == "gguf" and not applies:
        raise NanoKVError("weight_quantization", "gguf (4-bit GGUF matrices kept packed for torch's CPU int4 "
                          f"product) needs a GGUF model, device cpu and tensor_parallel_size 1; got a {kind} "
                          f"model on {dev} at tensor_parallel_size {tp_size}: use none or auto")
    return "gguf" if mode == "gguf" or (mode == "auto" and applies) else "none"


# ---- random weights (benchmarks, tests) ------------------------------------------------------
def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the model expects, by HF name, with its full (unsharded) shape."""
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        })
        if cfg.attention_bias:
            shapes.update({p + f"self_attn.{n}_proj.bias": (s,) for n, s in (("q", q), ("k", kv), ("v", kv))})
        if cfg.attention_out_bias:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    return shapes


def iter_random_weights(cfg: ModelConfig, seed: int = 0, std: float | None = None,
                        device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Full float32 HF-named weights one at a time, norms at 1.

    std=None: projections N(0, 1/fan_in), embeddings N(0, 0.02). With N(0, 0.02) everywhere a
    shallow tied-embedding model only echoes its last input token (the residual stream is that
    token's embedding), which makes greedy comparisons meaningless; unit-gain projections make the
    layers' context-dependent outputs dominate the stream. Drawn on the CPU so every device gets the same weights.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name, shape in hf_shapes(cfg).items():
        if name.endswith("norm.weight"):
            w = torch.ones(shape)
        else:
            s = std if std is not None else (0.02 if "embed" in name or len(shape) == 1 else shape[-1] ** -0.5)
            w = torch.randn(shape, generator=g) * s
        yield name, w.to(device)


def random_state_dict(cfg: ModelConfig, seed: int = 0, std: float | None = None,
                      device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """iter_random_weights as a dict (what save_hf_folder takes)."""
    return dict(iter_random_weights(cfg, seed, std, device))


def random_model(preset_or_config: str | ModelConfig, dtype: torch.dtype | str = "float32",
                 device: torch.device | str = "cpu", seed: int = 0,
                 tp_rank: int = 0, tp_size: int = 1) -> tuple[LlamaForCausalLM, ModelConfig]:
    """A seeded random-weight model and its config (like load_model); every TP rank gets its shard
    of the same full weights, and every device the same values (drawn on the CPU)."""
    cfg = ModelConfig.preset(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    model = build_model(cfg.validate(), dtype, device, tp_rank, tp_size)
    with torch.no_grad():
        model.load_weights(iter_random_weights(cfg, seed, device=device))
    return model, cfg


def save_hf_folder(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], folder: str) -> str:
    """Write config.json + model.safetensors (HF names) that load_model and HF can both read."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder
