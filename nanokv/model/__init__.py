"""Llama-family decoder, its layers and loaders (GGUF, HF safetensors, random weights).

Model code sees tensors and one AttentionMetadata; it never imports nanokv.engine or nanokv.cache.
"""

from nanokv.model.config import ModelConfig
from nanokv.model.llama import LlamaForCausalLM
from nanokv.model.loader import embedded_model_path, load_model, load_tokenizer, random_model

__all__ = ["LlamaForCausalLM", "ModelConfig", "embedded_model_path", "load_model", "load_tokenizer",
           "random_model"]
