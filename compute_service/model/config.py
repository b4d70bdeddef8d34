"""ModelConfig: the architecture facts the decoder needs, from an HF config.json, GGUF or a preset.

One dataclass covers the Llama family: Llama 2/3 (llama3 rope scaling), SmolLM2, Mistral,
Qwen2/2.5 (bias on q/k/v) and Qwen3 (per-head q/k RMSNorm, explicit head_dim). GGUF metadata is
translated in `gguf_loader.py`; this file only knows the HF dialect.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from nanokv.compute_service.distributed import HeadRange, head_ranges
from nanokv.errors import NanoKVError

# HF `architectures` entry -> our family name
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
FAMILIES = tuple(sorted(set(HF_ARCHITECTURES.values())))
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def unsupported_architecture(name: str) -> NanoKVError:
    return NanoKVError(
        "architecture",
        f"unsupported model architecture {name!r}; supported: {', '.join(sorted(HF_ARCHITECTURES))} "
        f"(model types {', '.join(FAMILIES)})",
    )


@dataclass
class ModelConfig:
    architecture: str  # family: one of FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # None (plain RoPE) or {"rope_type": "linear"|"llama3"|"freq_factors", ...parameters}
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    attention_out_bias: bool = False  # bias on o_proj (Llama/Qwen3 attention_bias sets both)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Mistral v0.1-style window; the paged kernels attend to the full context, so callers should
    # cap max_model_len at this value (recorded, not enforced here)
    sliding_window: int | None = None

    # ---- validation -----------------------------------------------------------------------
    def validate(self) -> ModelConfig:
        if self.architecture not in FAMILIES:
            raise unsupported_architecture(self.architecture)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise NanoKVError(name, f"got {v!r}; must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise NanoKVError("num_key_value_heads", f"{self.num_key_value_heads} does not divide "
                              f"num_attention_heads {self.num_attention_heads}")
        if self.head_dim % 2:
            raise NanoKVError("head_dim", f"got {self.head_dim}; RoPE needs an even head_dim")
        rtype = (self.rope_scaling or {}).get("rope_type", "default")
        if rtype not in ROPE_TYPES:
            raise NanoKVError("rope_scaling", f"rope_type {rtype!r} is not supported; "
                              f"supported: {', '.join(ROPE_TYPES)}")
        return self

    def head_ranges(self, tp_size: int, rank: int) -> tuple[HeadRange, HeadRange]:
        """((first q head, count), (first kv head, count)) TP `rank` holds; see distributed.head_ranges."""
        return head_ranges(self.num_attention_heads, self.num_key_value_heads, tp_size, rank)

    def heads_per_rank(self, tp_size: int, rank: int = 0) -> tuple[int, int]:
        """(query heads, kv heads) TP `rank` holds; rank 0 holds the most (uneven splits give the
        extra heads to the first ranks). Raises NanoKVError when tp_size cannot split the heads."""
        (_, hq), (_, hkv) = self.head_ranges(tp_size, rank)
        return hq, hkv

    # ---- HF config.json -------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        archs = d.get("architectures") or []
        family = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
        if family is None:
            family = d.get("model_type") if d.get("model_type") in FAMILIES else None
        if family is None:
            raise unsupported_architecture(str(archs[0] if archs else d.get("model_type")))
        if d.get("hidden_act", "silu") != "silu":
            raise NanoKVError("hidden_act", f"got {d.get('hidden_act')!r}; only 'silu' is supported")
        if d.get("mlp_bias"):
            raise NanoKVError("mlp_bias", "MLP biases are not supported")
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // heads
        theta, scaling = _rope_from_hf(d)
        bias = bool(d.get("attention_bias", False))
        window = d.get("sliding_window")
        if family == "qwen2" and not d.get("use_sliding_window", False):
            window = None
        eos: list[int] = []
        for src in (d, generation_config or {}):
            e = src.get("eos_token_id")
            for t in [e] if isinstance(e, int) else (e or []):
                if int(t) not in eos:
                    eos.append(int(t))
        return cls(
            architecture=family,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if family == "qwen2" else bias,
            attention_out_bias=False if family == "qwen2" else bias,
            qk_norm=family == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
            sliding_window=int(window) if window else None,
        ).validate()

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json for this model (what `save_hf_folder` writes and HF can read back)."""
        arch = next(a for a, f in HF_ARCHITECTURES.items() if f == self.architecture)
        rope: dict[str, Any] = {"rope_type": "default"}
        if self.rope_scaling:
            rope = dict(self.rope_scaling)
        d: dict[str, Any] = {
            "architectures": [arch], "model_type": self.architecture, "hidden_act": "silu",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
            "torch_dtype": "float32",
        }
        if self.architecture != "qwen2":
            d["attention_bias"] = self.attention_bias
        if rope["rope_type"] != "default":
            d["rope_scaling"] = rope
        # transformers >= 5 reads rope settings from rope_parameters
        d["rope_parameters"] = {**rope, "rope_theta": self.rope_theta}
        return d

    # ---- presets ---------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        if name not in _PRESETS:
            raise NanoKVError("model", f"unknown preset {name!r}; presets: {', '.join(sorted(_PRESETS))}")
        return copy.deepcopy(_PRESETS[name]).validate()  # callers may edit their copy

    @staticmethod
    def preset_names() -> list[str]:
        return sorted(_PRESETS)


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers 4 (rope_theta/rope_scaling) or 5 (rope_parameters)."""
    params = dict(d.get("rope_parameters") or {})
    legacy = dict(d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    merged = {**legacy, **params}
    rtype = merged.pop("rope_type", merged.pop("type", "default"))
    if rtype == "default":
        return theta, None
    if rtype not in ROPE_TYPES:
        raise NanoKVError("rope_scaling", f"rope_type {rtype!r} is not supported; "
                          f"supported: {', '.join(ROPE_TYPES[:3])}")
    return theta, {"rope_type": rtype, **merged}


_PRESETS: dict[str, ModelConfig] = {
    # the real Qwen3-0.6B architecture (random weights for GPU benchmarks)
    "qwen3-0.6b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
        tie_word_embeddings=True, qk_norm=True, bos_token_id=151643, eos_token_ids=[151645, 151643],
    ),
    # the real Llama-3-8B architecture (random weights: the memory hierarchy's and serving benchmarks)
    "llama3-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=[128001, 128009],
    ),
    # the SmolLM2-135M architecture (the embedded model), for random-weight runs
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2],
    ),
    # tiny Qwen3: 6 q heads over 2 kv heads (3 q heads per rank at tp 2), head_dim*heads != hidden,
    # and a vocab that tp 2 must pad
    "tiny-qwen3": ModelConfig(
        architecture="qwen3", vocab_size=1003, hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=1024,
        tie_word_embeddings=True, qk_norm=True, bos_token_id=1, eos_token_ids=[2],
    ),
    # tiny Qwen3 whose heads split unevenly: 6 q heads over 3 kv heads (tp 2: rank 0 holds kv heads
    # 0-1 with q heads 0-3, rank 1 kv head 2 with q heads 4-5); untied head, vocab tp 2 must pad
    "tiny-qwen3-kv3": ModelConfig(
        architecture="qwen3", vocab_size=1001, hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=1024,
        tie_word_embeddings=False, qk_norm=True, bos_token_id=1, eos_token_ids=[2],
    ),
    # tiny Llama: one kv head (replicated on every rank at tp > 1), untied head, llama3 rope
    "tiny-llama": ModelConfig(
        architecture="llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        rope_theta=500000.0, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=[2],
    ),
}
