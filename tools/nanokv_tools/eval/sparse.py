"""One setting's own view of one evaluated sequence: its block table with holes, and its peak bytes.

All settings of an eval run share one block table from the engine's cache manager (the
full-precision reference must keep every block). A sparse setting reads through a copy of that
table in which its dropped blocks are -1 holes, so its runner really attends to the sparse cache
and never sees a dropped block, while the reference still reads them all. A demoted block
(hybrid) is copied as INT4 into a slot of the setting runner's demotion store (nanokv.kv.demote)
and its entry in the copy becomes -2 - slot, exactly as the engine does; the INT8 block is then
no longer the setting's (its copy of the table does not name it). `close()` gives the slots back.

After every step (`after_step`, called with the tokens computed so far) the view measures the
live bytes (nanokv.compute_service.sparsity.accounting: entries covering computed tokens, not holes, each at the
bytes that hold it: a pool block at its format's bytes, a store slot at the store's; the step's
peak, new blocks included), then folds the step's attention mass into the scores and applies the
policy, exactly as the cache service (nanokv.cache_service.sparsity.decide) does. Dense settings get a view too
(params None): it only measures.
"""

from __future__ import annotations

from typing import Any

from nanokv.cache_service.sparsity.state import SequenceSparsity
from nanokv.compute_service.sparsity.accounting import KVBytes
from nanokv.kv import demote, tier_transcode
from nanokv.sparsity import SparsityParams


class SparseView:
    def __init__(self, params: SparsityParams | None, runner: Any, table: list[int], kv_bytes: KVBytes,
                 tier_bits: int | None = None) -> None:
        self.params = params
        # a lower-tier setting: every block that fills is round-tripped through that tier's format
        # (as if it had been written down and loaded back: nanokv.kv.tier_transcode), once
        self.tier_bits = tier_bits
        self.tiered = 0  # leading blocks of the table already round-tripped
        self.runner = runner
        self.table = list(table)  # this setting's copy: -1 where it dropped a block, -2 - j where it demoted one
        self.kv_bytes = kv_bytes
        self.state = SequenceSparsity(params, kv_bytes.block_size) if params is not None else None
        self.peak_bytes = 0
        self.peak_blocks = 0  # entries held at once, pool blocks and store slots alike
        # summed over steps, after the step's plan: full blocks, and how many were dropped / demoted
        self.totals = {"full": 0, "dropped": 0, "demoted": 0}
        # the same counts after the last step so far: at the sequence's end, the steady state the budget reaches
        self.last = {"full": 0, "dropped": 0, "demoted": 0}
        self.store: demote.DemotionStore | None = runner.demotion_store \
            if params is not None and params.demotes else None
        self.store_full = 0  # demotions refused because the store had no free slot (sized not to happen)

    def after_step(self, num_computed_tokens: int) -> None:
        if self.tier_bits is not None:
            self._through_tier(num_computed_tokens // self.kv_bytes.block_size)
        st = self.state
        self.peak_bytes = max(self.peak_bytes, self.kv_bytes.live(self.table, num_computed_tokens))
        n = -(-num_computed_tokens // self.kv_bytes.block_size)
        self.peak_blocks = max(self.peak_blocks, sum(1 for b in self.table[:n] if b != -1))
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
            self._release(i)
        st.commit(plan.drop, self._demote(plan.demote) if plan.demote else ())
        self.last = {"full": num_computed_tokens // self.kv_bytes.block_size, "dropped": len(st.dropped),
                     "demoted": len(st.demoted)}
        for k, v in self.last.items():
            self.totals[k] += v

    def _through_tier(self, full: int) -> None:
        """Blocks [tiered, full) just filled: after this step's attention they read as tier blocks."""
        import torch

        ids = [b for b in self.table[self.tiered:full] if b >= 0]
        self.tiered = max(self.tiered, full)
        if not ids:
            return
        assert self.tier_bits is not None
        idx = torch.tensor(ids, dtype=torch.long)
        for cache in self.runner.kv_caches:
            tier_transcode.round_trip(cache, idx, self.tier_bits)

    def _demote(self, logical: list[int]) -> list[int]:
        """Move these int8 blocks into the store; returns the logical indices really moved."""
        if self.store is None:
            return []
        slots = self.store.take(len(logical))
        self.store_full += len(logical) - len(slots)
        done = logical[:len(slots)]
        self.store.demote([self.table[i] for i in done], slots)
        for i, j in zip(done, slots):
            self.table[i] = demote.code(j)
        return done

    def _release(self, i: int) -> None:
        """Entry i becomes a hole; a store slot it held goes back to the store."""
        if self.table[i] <= -2:
            assert self.store is not None
            self.store.release_code(self.table[i])
        self.table[i] = -1

    def close(self) -> None:
        """The sequence is over: give back every store slot this view holds."""
        for i, b in enumerate(self.table):
            if b <= -2:
                self._release(i)
