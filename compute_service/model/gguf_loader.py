"""GGUF checkpoints: ModelConfig from the metadata, weights dequantized to float32 with HF names
(or, with keep_q4, the decoder layers' Q4_0/Q4_1 matrices as qlinear.Q4Rows, kept 4-bit).

llama.cpp stores the "llama" architecture's q/k projection rows permuted (each head's two rotary
halves interleaved, for its GPT-J-style rope kernel). Our RoPE rotates halves like HF, so those
rows are put back here; qwen2/qwen3 GGUFs use neox rope in llama.cpp and are stored unpermuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from nanokv.compute_service.model.config import ModelConfig
from nanokv.compute_service.model.gguf_file import GGUFFile
from nanokv.compute_service.model.layers.qlinear import QTYPES, Int4Linear, Q4Rows
from nanokv.errors import NanoKVError

# general.architecture -> our family
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_PERMUTED_QK = {"llama"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<gguf> -> model.layers.N.<hf>
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _reader(path: str) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (ValueError, OSError) as e:
        raise NanoKVError("model", f"{path} is not a readable GGUF file: {e}") from None


def _meta(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.get(key, default)


def gguf_model_config(reader: Any) -> ModelConfig:
    arch = _meta(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise NanoKVError("architecture", f"unsupported GGUF architecture {arch!r}; supported: "
                          f"{', '.join(sorted(GGUF_ARCHITECTURES))}")
    names = {t.name: t for t in reader.tensors}

    def get(key: str, default: Any = None) -> Any:
        v = _meta(reader, f"{arch}.{key}", default)
        if isinstance(v, list):  # per-layer arrays (hybrid models): only uniform ones are ours
            if len(set(v)) != 1:
                raise NanoKVError("model", f"GGUF {arch}.{key} varies by layer; not supported")
            v = v[0]
        return v

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rot = get("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise NanoKVError("model", f"partial rotary (rope.dimension_count {rot} < head_dim {head_dim}) "
                          "is not supported")
    vocab = get("vocab_size")
    if vocab is None:
        vocab = int(names["token_embd.weight"].shape[1])  # ggml shape is [hidden, vocab]
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        t = _meta(reader, key)
        if t is not None and int(t) not in eos:
            eos.append(int(t))
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch, names),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        attention_out_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos,
    ).validate()


def _rope_scaling(reader: Any, arch: str, names: dict[str, Any]) -> dict[str, Any] | None:
    if "rope_freqs.weight" in names:  # llama 3.1+: per-pair divisors precomputed by the converter
        factors = _dequantize(names["rope_freqs.weight"]).flatten().tolist()
        return {"rope_type": "freq_factors", "factors": factors}
    rtype = _meta(reader, f"{arch}.rope.scaling.type")
    if rtype in (None, "none"):
        return None
    if rtype == "linear":
        return {"rope_type": "linear", "factor": float(_meta(reader, f"{arch}.rope.scaling.factor"))}
    raise NanoKVError("rope_scaling", f"GGUF rope scaling {rtype!r} is not supported (linear, llama3 only)")


def _dequantize(t: Any) -> torch.Tensor:
    """One GGUF tensor -> float32 torch tensor in numpy (row-major) order: [out, in] for matrices."""
    from gguf.quants import dequantize

    try:
        arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise NanoKVError("model", f"tensor {t.name}: {e}") from None
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml lists dims fastest-first
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    # quantized types dequantize into a fresh array (shared without a copy); F32 is a read-only
    # view of the memory-mapped file, so it gets copied
    return torch.from_numpy(arr) if arr.flags.writeable else torch.tensor(arr)


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, rows (pair i, half a) were stored at
    2*i + a; HF order is a*D/2 + i.  w: [n_heads*D, ...] -> same shape."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    """llama.cpp tensor name -> HF name (None for tensors we don't load, e.g. rope_freqs)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _q4_rows(t: Any) -> Q4Rows:
    rows, cols = (int(n) for n in reversed(t.shape.tolist()))
    return Q4Rows.from_blocks(t.data, t.tensor_type.name, rows, cols)


def iter_gguf_weights(reader: Any, cfg: ModelConfig, keep_q4: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor | Q4Rows]]:
    """Yield (HF name, float32 tensor) one at a time, so at most one dequantized copy is alive.
    keep_q4: the decoder layers' Q4_0 / Q4_1 matrices come as Q4Rows instead (the embedding and an
    untied LM head stay float: they are looked up / replaced by lm_head_int4)."""
    arch = _meta(reader, "general.architecture")
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # folded into cfg.rope_scaling
        name = hf_name(t.name)
        if name is None:
            raise NanoKVError("model", f"GGUF tensor {t.name!r} is not understood by the llama loader")
        q4 = keep_q4 and t.tensor_type.name in QTYPES and name.startswith("model.layers.") and len(t.shape) == 2
        w: torch.Tensor | Q4Rows = _q4_rows(t) if q4 else _dequantize(t)
        if arch in _PERMUTED_QK and ".q_proj." in name:
            w = _unpermute_any(w, cfg.num_attention_heads)
        elif arch in _PERMUTED_QK and ".k_proj." in name:
            w = _unpermute_any(w, cfg.num_key_value_heads)
        yield name, w


def _unpermute_any(w: torch.Tensor | Q4Rows, n_heads: int) -> torch.Tensor | Q4Rows:
    return w.map_rows(lambda x: _unpermute(x, n_heads)) if isinstance(w, Q4Rows) else _unpermute(w, n_heads)


def lm_head_int4(reader: Any) -> Int4Linear | None:
    """The LM head's GGUF matrix (output.weight, else the tied token_embd.weight) packed for the CPU
    int4 product: Q4_0/Q4_1 as they are, Q8_0 split into nibbles (qlinear); None for other types."""
    names = {t.name: t for t in reader.tensors}
    t = names.get("output.weight", names.get("token_embd.weight"))
    if t is None:
        return None
    rows, cols = (int(n) for n in reversed(t.shape.tolist()))
    if t.tensor_type.name in QTYPES:
        return Int4Linear.from_q4(_q4_rows(t))
    if t.tensor_type.name == "Q8_0":
        return Int4Linear.from_q8_0(t.data, rows, cols)
    return None


def q4_share(reader: Any) -> float:
    """Fraction of the decoder layers' matrix weights stored as Q4_0/Q4_1 (what weight_quantization
    "gguf" keeps packed)."""
    total = q4 = 0
    for t in reader.tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            n = int(np.prod(t.shape))
            total += n
            q4 += n if t.tensor_type.name in QTYPES else 0
    return q4 / total if total else 0.0


def read_gguf(path: str, keep_q4: bool = False) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor | Q4Rows]]]:
    reader = _reader(path)
    cfg = gguf_model_config(reader)
    return cfg, iter_gguf_weights(reader, cfg, keep_q4)
