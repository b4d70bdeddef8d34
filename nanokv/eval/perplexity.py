"""Chunked, teacher-forced perplexity THROUGH the paged cache, every setting in lockstep.

Each window of `context` tokens is fed in chunks of `chunk` tokens; a chunk's K/V are stored
(quantized, for a compressed setting) and then its queries attend to the whole cache so far, so
every chunk reads the compressed K/V of all earlier chunks, exactly like serving. The full-precision
reference runs the same chunks on the same block table in the same loop, and each setting's logits
are compared with it right away (no [tokens, vocab] logits are kept).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanokv.eval.metrics import Comparison
from nanokv.eval.runners import Bench


def run_perplexity(bench: Bench, windows: list[list[int]], chunk: int,
                   progress: Callable[[int], None] | None = None) -> dict[str, Comparison]:
    """windows: token lists -> {setting: Comparison vs the full-precision cache}."""
    eng = bench.engine
    comps = {name: Comparison() for name in bench.runners}
    for w, toks in enumerate(windows):
        seq_id = f"eval-window-{w}"
        table = eng.cache_manager.allocate(seq_id, len(toks))
        if table is None:
            raise RuntimeError(f"cache too small for a {len(toks)}-token window")
        try:
            for start in range(0, len(toks), chunk):
                n = min(chunk, len(toks) - start)
                items = [(toks, start, n, table, True)]
                ref = eng.runner.execute(items, all_logits=True)  # [n, V] float32
                # position p predicts token p+1; the window's last token has no target
                m = min(n, len(toks) - 1 - start)
                targets = torch.tensor(toks[start + 1:start + 1 + m], dtype=torch.int64)
                for name, runner in bench.runners.items():
                    logits = runner.execute(items, all_logits=True)
                    if m > 0:
                        comps[name].add(ref[:m], logits[:m], targets)
                if progress is not None:
                    progress(max(m, 0))
        finally:
            eng.cache_manager.free(seq_id)
    return comps
