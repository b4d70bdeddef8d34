"""One setting's own view of one evaluated sequence: its block table with holes, and its peak bytes.

All settings of an eval run share one block table from the engine's cache manager (the
full-precision reference must keep every block). A sparse setting reads through a copy of that
table in which its dropped blocks are -1 holes, so its runner really attends to the sparse cache
and never sees a dropped block, while the reference still reads them all. Demoted blocks are
re-quantized in place in that setting's own KV tensors (nanokv.kv.demote).

After every step (`after_step`, called with the tokens computed so far) the view measures the
live bytes (nanokv.sparsity.accounting: blocks covering computed tokens, not holes, each at its
format's bytes: the step's peak, new blocks included), then folds the step's attention mass into
the scores and applies the policy, exactly as the engine's nanokv.sparsity.engine_hook does.
Dense settings get a view too (params None): it only measures.
"""

from __future__ import annotations

from typing import Any

from nanokv.kv import demote
from nanokv.sparsity.accounting import KVBytes
from nanokv.sparsity.policies import SparsityParams
from nanokv.sparsity.state import SequenceSparsity


class SparseView:
    def __init__(self, params: SparsityParams | None, runner: Any, table: list[int], kv_bytes: KVBytes) -> None:
        self.params = params
        self.runner = runner
        self.table = list(table)  # this setting's copy: -1 where it dropped a block
        self.kv_bytes = kv_bytes
        self.state = SequenceSparsity(params, kv_bytes.block_size) if params is not None else None
        self.peak_bytes = 0
        self.peak_blocks = 0
        # summed over steps, after the step's plan: full blocks, and how many were dropped / demoted
        self.totals = {"full": 0, "dropped": 0, "demoted": 0}
        self.int8_layers = [c for c in runner.kv_caches if demote.enable(c)] \
            if params is not None and params.demotes else []

    def after_step(self, num_computed_tokens: int) -> None:
        st = self.state
        demoted = st.demoted if st is not None else frozenset()
        self.peak_bytes = max(self.peak_bytes, self.kv_bytes.live(self.table, num_computed_tokens, demoted))
        n = -(-num_computed_tokens // self.kv_bytes.block_size)
        self.peak_blocks = max(self.peak_blocks, sum(1 for b in self.table[:n] if b >= 0))
        probe = getattr(self.runner, "attn_probe", None)
        if st is None:
            return
        if probe is not None:
            masses = probe.take()
            if masses and masses[0] is not None:
                mx, sm = masses[0]
                st.observe((mx if st.params.score_mode == "max" else sm).tolist())
        plan = st.plan(num_computed_tokens)
        for i in plan.drop:
            self.table[i] = -1
        phys = [self.table[i] for i in plan.demote]
        for cache in self.int8_layers:
            demote.demote(cache, phys)
        st.commit(plan.drop, plan.demote if self.int8_layers else ())
        t = self.totals
        t["full"] += num_computed_tokens // self.kv_bytes.block_size
        t["dropped"] += len(st.dropped)
        t["demoted"] += len(st.demoted)
