"""Per-sequence sparsity state: accumulated block scores, what was dropped and demoted, peak size.

Pure Python. One SequenceSparsity follows one sequence's block table from its first step; the
cache service (nanokv.cache_service.sparsity.decide) and the eval harness (nanokv_tools.eval.sparse)
both drive it:

    st.observe(step_mass)          # attention / hybrid: this step's mass per logical block
    p = st.plan(num_computed)      # which live full blocks to drop / demote now
    ... apply p (release blocks / punch holes, move blocks to the INT4 demotion store) ...
    st.commit(dropped, demoted)    # what was really done (a shared block or a full store refuses)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from nanokv.cache_service.sparsity.policies import Plan, plan
from nanokv.sparsity import SparsityParams


class SequenceSparsity:
    def __init__(self, params: SparsityParams, block_size: int) -> None:
        self.params = params
        self.block_size = block_size
        self.scores: list[float] = []  # per logical block, accumulated per params.score_mode
        self.dropped: set[int] = set()
        self.demoted: set[int] = set()

    def observe(self, step_mass: Sequence[float]) -> None:
        """step_mass[i]: attention mass logical block i got this step, already reduced over the
        step's queries the same way (max or sum) as it accumulates across steps."""
        sc = self.scores
        if len(sc) < len(step_mass):
            sc.extend([0.0] * (len(step_mass) - len(sc)))
        if self.params.score_mode == "max":
            for i, m in enumerate(step_mass):
                if m > sc[i]:
                    sc[i] = float(m)
        else:
            for i, m in enumerate(step_mass):
                sc[i] += float(m)

    def live_full(self, num_computed_tokens: int) -> list[int]:
        n_full = num_computed_tokens // self.block_size
        return [i for i in range(n_full) if i not in self.dropped]

    def plan(self, num_computed_tokens: int) -> Plan:
        n_full = num_computed_tokens // self.block_size
        return plan(self.params, n_full, self.live_full(num_computed_tokens), self.scores, self.demoted)

    def commit(self, dropped: Iterable[int], demoted: Iterable[int] = ()) -> None:
        self.dropped.update(dropped)
        self.demoted.update(demoted)
        self.demoted -= self.dropped
