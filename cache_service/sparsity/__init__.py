"""Block sparsity, the cache service's part: which blocks of each sequence go, and when.

  policies.py  which full blocks to keep: streaming / interval / attention / hybrid, one budget
  state.py     one sequence's accumulated scores, dropped and demoted blocks
  slots.py     the INT4 demotion store's free list (its tensors live in the compute service)
  decide.py    the planner's call: after a plan's news, drop and demote per policy

Pure Python. The compute service measures what the attention policies rank by (per-block
attention mass, in the step reply: nanokv.compute_service.sparsity) and makes the INT4 copies the
plan asks for (PlanReply.demotions, relayed in the next StepRequest). The settings: nanokv.sparsity.
"""

from nanokv.cache_service.sparsity.policies import Plan, keep_budget, plan
from nanokv.cache_service.sparsity.state import SequenceSparsity
from nanokv.sparsity import POLICIES, SparsityParams

__all__ = ["POLICIES", "Plan", "SequenceSparsity", "SparsityParams", "keep_budget", "plan"]
