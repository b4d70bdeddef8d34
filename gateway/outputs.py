"""Per-token handling: a sampled token joins its sequence, the stop checks run, and the request's
output (RequestOutput) is built from it. Called by the engine's step (sync and async) for every
sampled token; no torch here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanokv.gateway.detokenizer import check_stop_strings, detokenize_step
from nanokv.gateway.sequence import RequestMetrics, Sequence, TokenLogprob

if TYPE_CHECKING:
    from nanokv.gateway.engine import Engine


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far; while unfinished a live view (copy to keep)
    new_token_ids: list[int]
    text: str
    delta_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None
    metrics: RequestMetrics
    error: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    extra: dict[str, Any] = field(default_factory=dict)
    # num_cached_tokens per tier ("L1", "L2", "L3") when lower tiers served part of it, else None
    cached_tokens_by_tier: dict[str, int] | None = None


def on_token(eng: Engine, seq: Sequence, tok: int, lp: tuple[float, dict[int, float]] | None,
             finished_only: bool = False, replace: bool = False) -> RequestOutput | None:
    """The sampled token `tok` joins `seq` (replace: it takes the async placeholder's place);
    stop checks; the request's output unless `finished_only` and it goes on."""
    now = time.monotonic()
    if replace:
        seq.set_last_token(tok)
    else:
        seq.append_token(tok)
    eng.scheduler.note_token(seq, tok)
    eng.counters.tokens["generation_tokens"] += 1
    if seq.metrics.first_token_time is None:
        seq.metrics.first_token_time = now
    if lp is not None:
        seq.logprobs.append({"token_id": tok, "logprob": lp[0], "top": lp[1]})
    p = seq.params
    reason = None
    before = len(seq.text)
    delta_len = 0
    if eng.tokenizer is not None:
        delta_len = len(detokenize_step(eng.tokenizer, seq))
    if not p.ignore_eos and tok in eng.eos_token_ids:
        reason = "stop"
    elif tok in p.stop_token_ids:
        reason, seq.stop_reason = "stop", tok
    elif check_stop_strings(seq, delta_len):
        reason = "stop"
    elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= eng.max_model_len:
        reason = "length"
    if reason is not None:
        seq.finish_reason = reason
        seq.metrics.finish_time = now
        eng.retire(seq)
    elif finished_only:
        return None
    new_tokens = seq.output_token_ids[seq.sent_tokens:]
    seq.sent_tokens = seq.num_output_tokens
    delta_text = seq.text[min(before, len(seq.text)):] if reason is None else seq.text[seq.sent_text_len:]
    seq.sent_text_len = len(seq.text)
    return RequestOutput(
        request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
        # copying the whole output on every token is O(n^2) per request: only the final one is a copy
        token_ids=list(seq.output_token_ids) if reason is not None else seq.output_token_ids,
        new_token_ids=new_tokens, text=seq.text,
        delta_text=delta_text, finished=reason is not None, finish_reason=reason,
        num_cached_tokens=seq.num_cached_tokens, logprobs=list(seq.logprobs) if p.logprobs is not None else None,
        metrics=seq.metrics, stop_reason=seq.stop_reason, cached_tokens_by_tier=seq.cached_tokens_by_tier,
    )
