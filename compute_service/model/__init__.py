"""Llama-family decoder, its layers and loaders (GGUF, HF safetensors, random weights).

Model code sees tensors and one AttentionMetadata; it never imports nanokv.gateway or nanokv.cache_service.
"""

from nanokv.compute_service.model.config import ModelConfig
from nanokv.compute_service.model.llama import LlamaForCausalLM
from nanokv.compute_service.model.loader import embedded_model_path, load_model, load_tokenizer, random_model

__all__ = ["LlamaForCausalLM", "ModelConfig", "embedded_model_path", "load_model", "load_tokenizer",
           "random_model"]
