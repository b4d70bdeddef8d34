"""Checks on a Plan call before it touches anything: a plan is one transaction, so a bad one must
be rejected whole (a half-applied plan would leave sequences registered or blocks held that the
gateway does not know of).

Malformed values (negative or huge ids and lengths, counts that do not add up) are NanoKVError
(INVALID_ARGUMENT); values that are well formed but do not fit the cache's state (a sequence it
does not hold, another gateway's sequence, a sequence admitted twice) are PreconditionError
(FAILED_PRECONDITION). Pure Python, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanokv.errors import NanoKVError, PreconditionError
from nanokv.messages import PlanRequest

if TYPE_CHECKING:
    from nanokv.cache_service.planner import Planner

MAX_ID = 1 << 62  # sequence ids are a gateway's counter; anything near 2**63 is garbage
MAX_TOKEN_ID = 1 << 31  # vocabularies are far smaller; the cache only hashes the ids
MAX_SALT_CHARS = 4096


def _ids(field: str, values: list[int]) -> None:
    for v in values:
        if not 0 <= v < MAX_ID:
            raise NanoKVError(field, f"sequence id {v} out of range; allowed: [0, 2**62)")


def validate_plan(planner: Planner, req: PlanRequest) -> None:
    cm = planner.manager
    capacity = cm.num_blocks * cm.block_size  # no sequence can hold more tokens than the pool
    owner = req.gateway_id
    lengths: dict[int, int] = {}  # sequences this plan may touch -> token count after its appends

    def known(field: str, seq_id: int) -> None:
        if seq_id in lengths:
            return
        st = planner._seqs.get(seq_id)
        if st is None:
            raise PreconditionError(field, f"unknown sequence id {seq_id}")
        if st.owner != owner:
            raise PreconditionError(field, f"sequence {seq_id} belongs to another gateway")
        lengths[seq_id] = len(st.token_ids)

    for ns in req.new_seqs:
        _ids("new_seqs.seq_id", [ns.seq_id])
        if ns.seq_id in planner._seqs or ns.seq_id in lengths:
            raise PreconditionError("new_seqs", f"sequence id {ns.seq_id} is already registered")
        if not 0 < len(ns.token_ids) <= capacity:
            raise NanoKVError("new_seqs.token_ids", f"{len(ns.token_ids)} tokens; allowed: 1 to {capacity} "
                                                    "(the pool's blocks x block_size)")
        if any(not 0 <= t < MAX_TOKEN_ID for t in ns.token_ids):
            raise NanoKVError("new_seqs.token_ids", "token ids must be in [0, 2**31)")
        if ns.cache_salt is not None and len(ns.cache_salt) > MAX_SALT_CHARS:
            raise NanoKVError("new_seqs.cache_salt", f"at most {MAX_SALT_CHARS} characters")
        lengths[ns.seq_id] = len(ns.token_ids)
    for seq_id, tok in req.appended:
        _ids("appended", [seq_id])
        known("appended", seq_id)
        if not 0 <= tok < MAX_TOKEN_ID:
            raise NanoKVError("appended", f"token id {tok} out of range; allowed: [0, 2**31)")
        lengths[seq_id] += 1
        if lengths[seq_id] > capacity:
            raise NanoKVError("appended", f"sequence {seq_id} would exceed {capacity} tokens")
    for seq_id, num_computed in req.commits:
        _ids("commits", [seq_id])
        known("commits", seq_id)
        if not 0 <= num_computed <= lengths[seq_id]:
            raise NanoKVError("commits", f"sequence {seq_id}: {num_computed} computed tokens; allowed: "
                                         f"0 to its {lengths[seq_id]} tokens")
    max_blocks = cm.num_blocks
    for seq_id, mass in req.block_scores:  # an unknown id is ignored (ended while its step ran)
        _ids("block_scores", [seq_id])
        st = planner._seqs.get(seq_id)
        if st is not None and st.owner != owner:
            raise PreconditionError("block_scores", f"sequence {seq_id} belongs to another gateway")
        if len(mass) > max_blocks or any(not 0.0 <= m < float("inf") for m in mass):
            raise NanoKVError("block_scores", f"sequence {seq_id}: {len(mass)} scores; allowed: at most "
                                              f"{max_blocks} (the pool's blocks), each a finite number >= 0")
    _ids("finished", req.finished)
    for seq_id in req.finished:  # an id the cache never saw is fine (aborted before its first plan)
        st = planner._seqs.get(seq_id)
        if st is not None and st.owner != owner:
            raise PreconditionError("finished", f"sequence {seq_id} belongs to another gateway")
    ended = set(req.finished)
    if req.is_news_only:
        return
    _ids("running", req.running)
    if len(set(req.running)) != len(req.running):
        raise NanoKVError("running", "a sequence id appears twice")
    for seq_id in req.running:
        known("running", seq_id)
        if seq_id in ended or not cm.has_seq(seq_id):
            raise PreconditionError("running", f"sequence {seq_id} holds no blocks (not admitted, or ended)")
    running = set(req.running)
    for seq_id, target, n in req.grows:
        if seq_id not in running:
            raise PreconditionError("grows", f"sequence {seq_id} is not in running")
        if not 0 <= target <= capacity or not 0 <= n <= target:
            raise NanoKVError("grows", f"sequence {seq_id}: ({target} tokens, {n} new); allowed: "
                                       f"0 <= new <= tokens <= {capacity}")
    _ids("waiting", [w[0] for w in req.waiting])
    for seq_id, num_tokens, before in req.waiting:
        known("waiting", seq_id)
        if seq_id in running or seq_id in ended or cm.has_seq(seq_id):
            raise PreconditionError("waiting", f"sequence {seq_id} is running, ended or already holds blocks")
        if not 0 < num_tokens <= lengths[seq_id] or not 0 <= before <= lengths[seq_id]:
            raise NanoKVError("waiting", f"sequence {seq_id}: ({num_tokens} tokens, {before} computed before); "
                                         f"allowed: 1 to {lengths[seq_id]} tokens, 0 to that many computed")
    if len({w[0] for w in req.waiting}) != len(req.waiting):
        raise NanoKVError("waiting", "a sequence id appears twice")
