"""Incremental detokenization and stop-string handling for one sequence."""

from __future__ import annotations

from typing import Any

from nanokv.gateway.sequence import Sequence

# Tokens of context decoded before the new ones, so byte-level merges and leading spaces come out
# exactly as a full decode would produce them.
_CONTEXT_TOKENS = 6


def detokenize_step(tokenizer: Any, seq: Sequence) -> str:  # a transformers tokenizer
    """Append the text of newly generated tokens to seq.text; returns the new text.

    A trailing U+FFFD means an incomplete UTF-8 sequence: wait for the next token.
    """
    out = seq.output_token_ids
    prefix_text: str = tokenizer.decode(out[seq.prefix_offset:seq.read_offset], skip_special_tokens=True)
    full_text: str = tokenizer.decode(out[seq.prefix_offset:], skip_special_tokens=True)
    if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
        return ""
    delta = full_text[len(prefix_text):]
    seq.read_offset = len(out)
    seq.prefix_offset = max(0, seq.read_offset - _CONTEXT_TOKENS)
    seq.text += delta
    return delta


def check_stop_strings(seq: Sequence, new_text_len: int) -> bool:
    """If a stop string appeared in the newly added text, trim seq.text and return True."""
    stops = seq.params.stop
    if not stops or not new_text_len:
        return False
    longest = max(len(s) for s in stops)
    start = max(0, len(seq.text) - new_text_len - longest + 1)
    best = -1
    hit = ""
    for s in stops:
        i = seq.text.find(s, start)
        if i != -1 and (best == -1 or i < best):
            best, hit = i, s
    if best == -1:
        return False
    end = best + len(hit) if seq.params.include_stop_str_in_output else best
    seq.text = seq.text[:end]
    seq.stop_reason = hit
    return True
