"""Prompts: the gateway's tokenizer, and a request's prompt turned into checked token ids (chat
template, tokenization, and the limits of the context and the KV cache). Errors are RequestErrors
naming the field at fault. No torch here.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from nanokv.config import EngineConfig
from nanokv.errors import RequestError
from nanokv.model_files import load_tokenizer
from nanokv.service_api import ComputeAPI


def load_gateway_tokenizer(config: EngineConfig, compute: ComputeAPI
                           ) -> tuple[Any, tempfile.TemporaryDirectory[str] | None]:
    """The model's tokenizer: from its files in process; from the compute service otherwise (the
    gateway needs no model files), loaded without torch. Also returns the folder its files were
    written to, which must live as long as the tokenizer."""
    model = config.model
    if model is not None and model.startswith("random:"):
        return None, None
    if not config.remote:
        return load_tokenizer(model), None
    files = compute.tokenizer_files()
    if not files:  # a compute service of random weights has no tokenizer
        return None, None
    folder = tempfile.TemporaryDirectory(prefix="nanokv-tokenizer-")
    for name, data in files.items():
        if os.path.basename(name) != name:
            raise ValueError(f"tokenizer file name {name!r}")
        with open(os.path.join(folder.name, name), "wb") as f:
            f.write(data)
    return load_tokenizer(folder.name, without_torch=True, kind="hf_tokenizer"), folder


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The token ids of a chat, through the model's chat template, ready for the assistant's turn."""
    if tokenizer is None:
        raise RequestError("messages", "this model has no tokenizer; send token ids")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise RequestError(f"messages[{i}].content", "must be a string")
        if m.get("role") not in ("system", "user", "assistant"):
            raise RequestError(f"messages[{i}].role", "allowed roles: system, user, assistant")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def tokenize(tokenizer: Any, prompt: str | list[int], vocab_size: int) -> list[int]:
    """A text prompt's token ids, or a token-id prompt checked against the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("prompt", "this model has no tokenizer; send token ids")
        if not prompt:
            raise RequestError("prompt", "must not be empty")
        return list(tokenizer(prompt)["input_ids"])
    if not isinstance(prompt, list) or not prompt:
        raise RequestError("prompt", "must be a non-empty string or a non-empty list of token ids")
    V = vocab_size
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V:
            raise RequestError("prompt", f"token id {t!r} out of range; allowed: integers in [0, {V})")
    return list(prompt)


def check_fits(n: int, max_tokens: int | None, max_model_len: int, block_size: int, num_kv_blocks: int) -> int:
    """A prompt of `n` tokens plus its output must fit the context and the whole KV cache. Returns
    the output token limit (max_tokens, or by default what the context leaves)."""
    L = max_model_len
    if n >= L:
        raise RequestError("prompt", f"prompt has {n} tokens; the context is {L} tokens "
                                     f"(max_model_len), so at most {L - 1} are allowed")
    max_tokens = max_tokens if max_tokens is not None else L - n
    if n + max_tokens > L:
        raise RequestError("max_tokens", f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the "
                                         f"context of {L} tokens; allowed: at most {L - n}")
    bs = block_size
    need = (n + max_tokens + bs - 1) // bs
    if need > num_kv_blocks:
        cap = num_kv_blocks * bs  # tokens the whole cache holds
        if n >= cap:
            raise RequestError("prompt", f"prompt has {n} tokens; the whole KV cache holds {cap}, so at most "
                                         f"{cap - 1} are allowed")
        raise RequestError("max_tokens", f"prompt + max_tokens needs {need} KV blocks but the whole cache "
                                         f"has {num_kv_blocks}; allowed: at most {cap - n}")
    return max_tokens
