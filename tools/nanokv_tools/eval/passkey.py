"""Passkey retrieval: a random 5-digit key hidden in filler text, answered greedily from the cache.

The prompt (Landmark-Attention style) is: an instruction, filler sentences with the key sentence
at a random depth, then "What is the pass key? The pass key is". The answer is greedy-decoded
through the paged cache of each setting (prefill stores the prompt's K/V in the setting's format,
every decode step reads it back), and is right when its first 5-digit number is the key. Small
models can be weak at this: the full-precision cache's accuracy is measured on the very same
prompts and each setting is reported relative to it.

A sparse setting sparsifies its own view of the table (nanokv_tools.eval.sparse) after the prefill and
after every decode step, so every answer token after the first reads the sparse cache. The prefill
is either one step (`chunk` None: what the engine does for a prompt within max_num_batched_tokens,
4,096 by default; attention scores then include the question's queries, as in SnapKV) or chunks of
`chunk` tokens with a sparsification after each (chunked prefill: the question itself already reads
the sparse cache). Peak live KV bytes per prompt go to bench.peak_bytes["passkey"].
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from nanokv_tools.eval.runners import Bench
from nanokv_tools.eval.sparse import SparseView

INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the pass key.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
MAX_NEW = 8


def build_prompt(tokenize: Callable[[str], list[int]], length: int, key: int, depth: float) -> list[int]:
    """Token ids of about `length` tokens with the key sentence at `depth` (0..1) of the filler."""
    intro, filler = tokenize(INTRO), tokenize(FILLER)
    key_ids, question = tokenize(KEY.format(key=key)), tokenize(QUESTION)
    room = length - len(intro) - len(key_ids) - len(question)
    reps = max(1, room // len(filler))
    at = round(depth * reps)
    ids = intro + filler * at + key_ids + filler * (reps - at)
    return ids + question


def greedy(runner: Any, ids: list[int], view: SparseView, max_new: int, stop: set[int],
           chunk: int | None = None) -> list[int]:
    """Prefill `ids` into the runner's cache (one step, or chunks of `chunk` tokens), then decode
    greedily up to max_new tokens; every step reads view.table and ends with view.after_step."""
    seq = list(ids)
    step = chunk or len(seq)
    for start in range(0, len(seq), step):
        n = min(step, len(seq) - start)
        logits = runner.execute([(seq, start, n, view.table, True)])  # [1, V]: last token of the chunk
        view.after_step(start + n)
    out: list[int] = []
    for _ in range(max_new):
        tok = int(logits[0].argmax())
        out.append(tok)
        if tok in stop or len(out) == max_new:
            break
        seq.append(tok)
        logits = runner.execute([(seq, len(seq) - 1, 1, view.table, False)])
        view.after_step(len(seq))
    return out


def answer_key(text: str) -> int | None:
    m = re.search(r"\d{5}", text)
    return int(m.group(0)) if m else None


def run_passkey(bench: Bench, lengths: list[int], trials: int, seed: int = 0,
                progress: Callable[[int], None] | None = None, chunk: int | None = None) -> dict[str, Any]:
    """-> {"fp": {length: accuracy}, setting: {length: accuracy}, ..., "samples": [...]}.

    chunk: prefill sparse settings in chunks of this many tokens (None: in one step, as dense ones)."""
    eng = bench.engine
    tok = eng.tokenizer
    if tok is None:
        raise RuntimeError("passkey needs a tokenizer")

    def tokenize(s: str) -> list[int]:
        return list(tok(s, add_special_tokens=False)["input_ids"])

    rng = random.Random(seed)
    runners = {"fp": eng.runner, **bench.runners}
    hits: dict[str, dict[int, int]] = {name: {L: 0 for L in lengths} for name in runners}
    samples: list[dict[str, Any]] = []
    for L in lengths:
        for t in range(trials):
            key, depth = rng.randint(10000, 99999), rng.random()
            ids = build_prompt(tokenize, L, key, depth)
            seq_id = f"passkey-{L}-{t}"
            table = eng.cache_manager.allocate(seq_id, len(ids) + MAX_NEW)
            if table is None:
                raise RuntimeError(f"cache too small for a {len(ids)}-token passkey prompt")
            try:
                row: dict[str, Any] = {"length": L, "prompt_tokens": len(ids), "key": key,
                                       "depth": round(depth, 3)}
                for name, runner in runners.items():
                    s = bench.settings.get(name)
                    sp = s.sparsity if s is not None else None
                    view = SparseView(sp, runner, table, bench.kv_bytes[name],
                                      s.tier_bits if s is not None else None)
                    text = tok.decode(greedy(runner, ids, view, MAX_NEW, eng.eos_token_ids,
                                             chunk if sp is not None else None))
                    bench.note_peak("passkey", name, view)
                    view.close()  # demotion-store slots back
                    ok = answer_key(text) == key
                    hits[name][L] += int(ok)
                    row[name] = text.strip()
                samples.append(row)
            finally:
                eng.cache_manager.free(seq_id)
            if progress is not None:
                progress(1)
    out: dict[str, Any] = {name: {str(L): hits[name][L] / trials for L in lengths} for name in runners}
    out["samples"] = samples
    return out
