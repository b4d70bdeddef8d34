"""Which replica a request goes to.

kv: each healthy replica's cost is the prefill it would do, in blocks (the prompt's full blocks minus
its longest cached prefix there, each block weighted by the tier holding it: replica.TIER_WEIGHT; a
block only in the shared tier counts alike on every replica, since each can load it), plus
``load_weight`` blocks per sequence it is running or holding in its queue: what this router has in
flight there (exact, at once) plus what the last GetServerInfo showed beyond that (other routers' and
clients'). Lowest cost wins; ties go round-robin; when the winner's load exceeds the least loaded's
by more than the mean load, the least loaded take the request. round_robin: the healthy replicas in turn.
The prompt's block hashes are the cache service's own (cache_service/hashing.py), salted with the
tenant exactly as the gateway salts them, so a tenant's prefixes attract only that tenant's requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from nanokv.cache_service.hashing import hash_full_blocks
from nanokv.errors import NanoKVError
from nanokv.gateway.grpc_api.generation import cache_salt
from nanokv.router.replica import Replica

POLICIES = ("kv", "round_robin")
BALANCE_MIN = 2  # sequences: below this imbalance the cost alone decides


@dataclass
class Choice:
    order: list[Replica]  # best first; the rest are fallbacks when the first cannot be reached
    predicted_hit_tokens: int
    prompt_tokens: int


def salt_of(tenant: str | None, client_salt: str | None) -> str | None:
    """The gateway's salt for this caller (nanokv.gateway.grpc_api.generation.cache_salt; HTTP's is the same)."""
    return cache_salt(tenant, client_salt or "")


class Router:
    def __init__(self, policy: str = "kv", load_weight: float = 0.25):
        if policy not in POLICIES:
            raise NanoKVError("routing", f"got {policy!r}; allowed values: {', '.join(POLICIES)}")
        if load_weight < 0:
            raise NanoKVError("load_weight", f"got {load_weight}; must be >= 0")
        self.policy = policy
        self.load_weight = load_weight
        self._turn = itertools.count()

    def choose(self, replicas: Sequence[Replica], token_ids: Sequence[int] | None, salt: str | None) -> Choice:
        reps = sorted(replicas, key=lambda r: r.name)
        n_tokens = len(token_ids) if token_ids is not None else 0
        if not reps:
            return Choice([], 0, n_tokens)
        start = next(self._turn) % len(reps)
        rotated = reps[start:] + reps[:start]
        if self.policy == "round_robin" or not token_ids:
            return Choice(rotated, 0, n_tokens)
        hashes: dict[tuple[int, str], list[bytes]] = {}
        # the shared tier's blocks, whichever replica put them there: the same credit for every replica
        shared = [s for rep in reps for s in rep.shared_sets()]
        scored = []
        for i, rep in enumerate(rotated):
            bs = rep.block_size
            if bs <= 0:  # no event yet: nothing known cached there
                hit, worth, full = 0, 0.0, 0
            else:
                key = (bs, rep.hash_algo)
                if key not in hashes:
                    # at most the blocks a cache can hit: one token is always left to compute
                    hashes[key] = hash_full_blocks(token_ids, bs, salt, rep.hash_algo,
                                                   max_blocks=(n_tokens - 1) // bs)
                hit, worth = rep.cached_prefix(hashes[key], shared)
                hit, full = hit * bs, n_tokens // bs
            load = rep.inflight + rep.others
            cost = (full - worth) + self.load_weight * load
            scored.append((cost, i, rep, hit, load))
        scored.sort(key=lambda s: (s[0], s[1]))
        # imbalance guard: when the winner holds far more than the least loaded (more than the mean
        # load, and BALANCE_MIN), the lightly loaded ones take it. Without it a replica whose cache is
        # cold (new, restarted) would never win against warm ones sharing a long common prefix
        loads = [s[4] for s in scored]
        least, mean = min(loads), sum(loads) / len(loads)
        if scored[0][4] - least > max(BALANCE_MIN, mean):
            scored.sort(key=lambda s: (s[4] > least + 1, s[0], s[1]))
        best = scored[0][2]
        if best.block_size > 0:
            best.expect(hashes[(best.block_size, best.hash_algo)])
        return Choice([s[2] for s in scored], scored[0][3], n_tokens)
