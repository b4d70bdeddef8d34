"""OpenAI request fields -> engine inputs, and engine outputs -> OpenAI response pieces.

Everything the engine would reject late (after queueing) is checked here first when it can be
checked cheaply, so a bad request fails in microseconds and names the field the client sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanokv.gateway.http.errors import OpenAIError
from nanokv.gateway.http.schemas import (
    ChatCompletionRequest,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from nanokv.gateway.sequence import TokenLogprob as LogprobEntry
from nanokv.sampling import SamplingParams


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int


def _check_common(req: CompletionRequest | ChatCompletionRequest, info: ModelInfo) -> None:
    if req.model != info.name:
        raise OpenAIError(
            404, f"model '{req.model}' does not exist; this server serves '{info.name}'",
            param="model", code="model_not_found",
        )
    if req.n != 1:
        msg = f"n: got {req.n}; only n=1 is supported (send one request per sample)"
        raise OpenAIError(400, msg, param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) != 0.0:
            raise OpenAIError(400, f"{name}: not supported; only 0 is allowed", param=name)
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(400, "stream_options: only allowed when stream is true", param="stream_options")


def _params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, logprobs: int | None,
            info: ModelInfo) -> SamplingParams:
    if max_tokens is not None and not isinstance(max_tokens, bool) and max_tokens > info.max_model_len:
        raise OpenAIError(
            400, f"max_tokens: got {max_tokens}; the model's context is {info.max_model_len} tokens",
            param="max_tokens",
        )
    # SamplingParams validates ranges and raises RequestError(field); the app maps it to a 400.
    return SamplingParams(
        temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p, seed=req.seed,
        max_tokens=max_tokens, stop=list([req.stop] if isinstance(req.stop, str) else req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, logprobs=logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )


def completion_inputs(req: CompletionRequest, info: ModelInfo) -> tuple[str | list[int], SamplingParams]:
    _check_common(req, info)
    if req.echo:
        raise OpenAIError(400, "echo: not supported; only false is allowed", param="echo")
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            msg = f"prompt: got a batch of {len(prompt)} prompts; send one prompt per request"
            raise OpenAIError(400, msg, param="prompt")
        prompt = prompt[0]
    if len(prompt) == 0:
        raise OpenAIError(400, "prompt: must not be empty", param="prompt")
    # token ids beyond the vocabulary are the engine's to check (it knows the model's vocab size)
    return prompt, _params(req, req.max_tokens, req.logprobs, info)


def chat_inputs(req: ChatCompletionRequest, info: ModelInfo) -> tuple[list[dict[str, str]], SamplingParams]:
    _check_common(req, info)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise OpenAIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= 20:
            msg = f"top_logprobs: got {req.top_logprobs}; allowed: 0 to 20"
            raise OpenAIError(400, msg, param="top_logprobs")
    messages = []
    for i, m in enumerate(req.messages):
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        if m.role == "user" and not text.strip():
            field = f"messages[{i}].content"
            raise OpenAIError(400, f"{field}: must not be empty", param=field)
        # The SmolLM-style templates know system/user/assistant; 'developer' is OpenAI's new 'system'.
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return messages, _params(req, max_tokens, logprobs, info)


# ---- outputs ---------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          by_tier: dict[str, int] | None = None) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens, cached_tokens_by_tier=by_tier),
    )


def completion_logprobs(entries: list[LogprobEntry], token_text: dict[int, str], offset: int) -> CompletionLogprobs:
    """`offset`: characters of generated text before these entries (OpenAI's text_offset)."""
    lp = CompletionLogprobs()
    for e in entries:
        tok = token_text.get(e["token_id"], "")
        lp.tokens.append(tok)
        lp.token_logprobs.append(e["logprob"])
        lp.top_logprobs.append({token_text.get(t, str(t)): v for t, v in _ranked(e["top"])})
        lp.text_offset.append(offset)
        offset += len(tok)
    return lp


def chat_logprobs(entries: list[LogprobEntry], token_text: dict[int, str]) -> ChatLogprobs:
    def top(tid: int, value: float) -> TopLogprob:
        tok = token_text.get(tid, "")
        return TopLogprob(token=tok, logprob=value, bytes=list(tok.encode("utf-8")))

    content = []
    for e in entries:
        chosen = top(e["token_id"], e["logprob"])
        alts = [top(t, v) for t, v in _ranked(e["top"])]
        content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=alts))
    return ChatLogprobs(content=content)


def _ranked(top: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda kv: -kv[1])

