"""Block sparsity and hybrid compression, the compute service's part (the cache service decides
which blocks go: nanokv.cache_service.sparsity; the settings: nanokv.sparsity).

  probe.py         attention mass per block from the step's own queries (torch; attention, hybrid)
  compute_hook.py  the compute service's hook: the probe's scores into the step reply, the INT4
                   demotion store's copies (nanokv.kv.demote) from the step request
  accounting.py    live KV bytes of a block table, each entry at the bytes of what holds it

Dropped blocks are -1 holes in the block table (positions stay true; every kernel masks holes);
demoted ones are entries -2 - j (slot j of the demotion store; their INT8 block went back to the
pool). Nothing computed after a hole or a demotion is published to the prefix cache, and the
INT4 copies never are.
"""
