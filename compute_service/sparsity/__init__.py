"""Block sparsity and hybrid compression: drop, or demote INT8 -> INT4, a fraction of each
sequence's full KV blocks while it runs.

  policies.py     which blocks to keep: streaming / interval / attention / hybrid, one budget (pure)
  state.py        one sequence's scores, dropped and demoted blocks (pure)
  probe.py        attention mass per block from the step's own queries (torch; attention, hybrid)
  engine_hook.py  the engine's one call per step: measure, plan, drop through the cache manager,
                  demote into the INT4 demotion store (nanokv.kv.demote)
  accounting.py   live KV bytes of a block table, each entry at the bytes of what holds it

Dropped blocks are -1 holes in the block table (positions stay true; every kernel masks holes);
demoted ones are entries -2 - j (slot j of the demotion store; their INT8 block went back to the
pool). Nothing computed after a hole or a demotion is published to the prefix cache, and the
INT4 copies never are.
"""

from nanokv.compute_service.sparsity.policies import POLICIES, Plan, SparsityParams, keep_budget, plan
from nanokv.compute_service.sparsity.state import SequenceSparsity

__all__ = ["POLICIES", "Plan", "SequenceSparsity", "SparsityParams", "keep_budget", "plan"]
