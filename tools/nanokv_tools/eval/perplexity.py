"""Chunked, teacher-forced perplexity THROUGH the paged cache, every setting in lockstep.

Each window of `context` tokens is fed in chunks of `chunk` tokens; a chunk's K/V are stored
(quantized, for a compressed setting) and then its queries attend to the whole cache so far, so
every chunk reads the compressed K/V of all earlier chunks, exactly like serving. The full-precision
reference runs the same chunks on the same block table in the same loop, and each setting's logits
are compared with it right away (no [tokens, vocab] logits are kept).

Block sparsity: after each chunk every sparse setting drops / demotes blocks in its own view of the
table (nanokv_tools.eval.sparse), so the next chunk really reads the sparse cache. Every setting's peak
live KV bytes and blocks per window go to bench.peak_bytes / peak_blocks["perplexity"].
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanokv_tools.eval.metrics import Comparison
from nanokv_tools.eval.runners import Bench
from nanokv_tools.eval.sparse import SparseView


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
        ref_view = SparseView(None, eng.runner, table, bench.kv_bytes["fp"])
        views = {name: SparseView(bench.settings[name].sparsity, runner, table, bench.kv_bytes[name],
                                  bench.settings[name].tier_bits) for name, runner in bench.runners.items()}
        try:
            for start in range(0, len(toks), chunk):
                n = min(chunk, len(toks) - start)
                ref = eng.runner.execute([(toks, start, n, table, True)], all_logits=True)  # [n, V] float32
                ref_view.after_step(start + n)
                # position p predicts token p+1; the window's last token has no target
                m = min(n, len(toks) - 1 - start)
                targets = torch.tensor(toks[start + 1:start + 1 + m], dtype=torch.int64)
                for name, runner in bench.runners.items():
                    view = views[name]
                    logits = runner.execute([(toks, start, n, view.table, True)], all_logits=True)
                    view.after_step(start + n)
                    if m > 0:
                        comps[name].add(ref[:m], logits[:m], targets)
                if progress is not None:
                    progress(max(m, 0))
        finally:
            eng.cache_manager.free(seq_id)
            for view in views.values():
                view.close()  # demotion-store slots back
        bench.note_peak("perplexity", "fp", ref_view)
        for name, view in views.items():
            bench.note_peak("perplexity", name, view)
    return comps
