"""Block sparsity and hybrid compression (issue 7): drop, or demote INT8 -> INT4, a fraction of each
sequence's full KV blocks while it runs.

  policies.py     which blocks to keep: streaming / interval / attention / hybrid, one budget (pure)
  state.py        one sequence's scores, dropped and demoted blocks (pure)
  probe.py        attention mass per block from the step's own queries (torch; attention, hybrid)
  engine_hook.py  the engine's one call per step: measure, plan, drop through the cache manager,
                  demote in place (nanokv.kv.demote)
  accounting.py   live KV bytes of a block table, each block at the bytes of its format

Dropped blocks are -1 holes in the block table (positions stay true; every kernel masks holes),
and a sparsified or demoted block is never published to the prefix cache.
"""

from nanokv.sparsity.policies import POLICIES, Plan, SparsityParams, keep_budget, plan
from nanokv.sparsity.state import SequenceSparsity

__all__ = ["POLICIES", "Plan", "SequenceSparsity", "SparsityParams", "keep_budget", "plan"]
