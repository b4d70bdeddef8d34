"""Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3 (one module, config flags).

Tokens of all sequences in a step are packed into one flat batch [T]; nothing here loops over
sequences or tokens. Attention finds its metadata and KV cache through the forward context.
Parameter names follow HF's except the fused qkv_proj and gate_up_proj (see load_weights).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from nanokv.compute_service.distributed import get_tp_rank, get_tp_size
from nanokv.compute_service.model.config import ModelConfig
from nanokv.compute_service.model.layers.activation import SiluAndMul
from nanokv.compute_service.model.layers.attention import Attention
from nanokv.compute_service.model.layers.embed import ParallelLMHead, VocabParallelEmbedding
from nanokv.compute_service.model.layers.fusion import qk_norm_rope
from nanokv.compute_service.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanokv.compute_service.model.layers.norm import RMSNorm
from nanokv.compute_service.model.layers.rotary import RotaryEmbedding
from nanokv.errors import NanoKVError

# checkpoint projection -> (our fused parameter, shard id)
_FUSED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        D = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, D, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.attention_bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        # o_proj reads exactly this rank's query heads (an uneven slice when the heads split unevenly)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * D, cfg.hidden_size, bias=cfg.attention_out_bias,
                                        input_range=(self.qkv_proj.q_start * D, self.q_size))
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, D, D**-0.5, layer_idx)
        self.head_dim = D
        self.v_rotation_folded = False  # see fold_value_rotation

    @torch.no_grad()
    def fold_value_rotation(self, r: torch.Tensor) -> None:
        """Make v_proj produce v R and o_proj take o R (r [D, D] orthonormal: a KV format's value
        rotation, nanokv.kv.rotation). Attention is linear in v, so with values stored as v R its
        output is o R, which the folded o_proj maps as o_proj mapped o: the two small GEMMs per layer
        and step that rotated v and o go (W_v per head -> R^T W_v, bias likewise; W_o per head -> W_o R)."""
        D, n, w = self.head_dim, self.q_size + self.kv_size, self.qkv_proj.weight  # w [(Hq + 2 Hk) D, hidden]
        ct = torch.promote_types(w.dtype, torch.float32)  # 16-bit weights: computed in fp32, rounded once
        rf = r.to(ct)
        wv = w[n:].to(ct).view(-1, D, w.shape[1])  # [Hk, D, hidden]
        w[n:] = torch.einsum("de,hdi->hei", rf, wv).reshape(-1, w.shape[1]).to(w.dtype)
        b = self.qkv_proj.bias
        if b is not None:
            b[n:] = torch.einsum("de,hd->he", rf, b[n:].to(ct).view(-1, D)).reshape(-1).to(b.dtype)
        wo = self.o_proj.weight  # [hidden, Hq D] (this rank's query heads)
        wo.copy_(torch.einsum("ihd,de->ihe", wo.to(ct).view(wo.shape[0], -1, D), rf).reshape(wo.shape).to(wo.dtype))
        self.v_rotation_folded = True

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """rope: (cos, sin) [T, 1, D/2] for this step's positions; x [T, hidden] -> [T, hidden]."""
        T, D, n, hq = x.shape[0], self.head_dim, self.q_size + self.kv_size, self.q_size // self.head_dim
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hk) * D]
        qk, v = qkv[:, :n].view(T, -1, D), qkv[:, n:]  # [T, Hq + Hk, D]: q's heads, then k's
        dt = self.attn.qk_dtype(qk)  # the attention's compute dtype: the RoPE kernel writes it
        rot = self.attn.qk_rotation(qk, dt)  # the KV format's q/k rotation, when the RoPE kernel applies it
        if self.q_norm is not None and self.k_norm is not None:
            qk = qk_norm_rope(qk, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, *rope, dt, hq, rot)
        else:
            qk = RotaryEmbedding.rotate(qk, *rope, dt, rot)
        o = self.attn(qk[:, :hq].reshape(T, -1), qk[:, hq:].reshape(T, -1), v, rotated=rot is not None)
        return self.o_proj(o)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        I = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [I, I])
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(I, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # residual carries the un-normalised stream; the add is fused into the next norm
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                          cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb.cos_sin(positions, x.dtype)  # once per step, not per layer
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    def __init__(self, model_config: ModelConfig):
        super().__init__()
        self.config = model_config
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.model = LlamaModel(model_config)
        self.lm_head = ParallelLMHead(model_config.vocab_size, model_config.hidden_size)
        if model_config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> final hidden states [T, hidden]."""
        if self.tp_size != get_tp_size():
            raise RuntimeError(f"model was built for tensor parallel size {self.tp_size} but this process "
                               f"runs at {get_tp_size()}; call compute_service.distributed.init_tensor_parallel first")
        return self.model(input_ids, positions)

    def fold_value_rotation(self, layer: int, r: torch.Tensor) -> None:
        """Layer `layer`'s weights produce and take values rotated by r (LlamaAttention's), once."""
        attn = self.model.layers[layer].self_attn
        assert isinstance(attn, LlamaAttention)
        if not attn.v_rotation_folded:
            attn.fold_value_rotation(r)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab], float32 or (float32=False) the model's dtype."""
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> set[str]:
        """Load full (unsharded) tensors by HF name; each parameter's weight_loader takes its shard.

        Returns the parameter names loaded. With `strict`, unknown names and parameters left
        unloaded raise NanoKVError.
        """
        params = dict(self.named_parameters())  # tied lm_head is listed once, as the embedding
        seen: dict[str, set[object]] = {}
        for name, tensor in weights:
            if "rotary_emb." in name:
                continue  # inv_freq buffers some checkpoints carry; recomputed from the config
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied checkpoints may still store a copy
            shard_id: object = None
            for src, (dst, sid) in _FUSED.items():
                if f".{src}." in name:
                    name, shard_id = name.replace(f".{src}.", f".{dst}."), sid
                    break
            param = params.get(name)
            if param is None:
                if strict:
                    raise NanoKVError("weights", f"checkpoint tensor {name!r} has no place in this model")
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, shard_id)
            seen.setdefault(name, set()).add(shard_id)
        missing = [n for n in params if seen.get(n, set()) != _expected_shards(n)]
        if strict and missing:
            raise NanoKVError("weights", f"checkpoint lacks tensors for {len(missing)} parameters, "
                              f"e.g. {missing[:4]}")
        return set(seen)


def _expected_shards(name: str) -> set[object]:
    if ".qkv_proj." in name:
        return {"q", "k", "v"}
    if ".gate_up_proj." in name:
        return {0, 1}
    return {None}


def default_weight_loader(param: nn.Parameter, full: torch.Tensor, shard_id: object = None) -> None:
    """Replicated parameters (norms): the whole tensor on every rank."""
    if param.shape != full.shape:
        raise NanoKVError("weights", f"checkpoint shape {tuple(full.shape)}, "
                          f"model expects {tuple(param.shape)}")
    param.data.copy_(full)
