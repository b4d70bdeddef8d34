"""Checks on a Step call before it touches anything: block ids outside the pool would make the
forward pass write another sequence's KV (or outside the segment), so a bad step is rejected whole
before its table deltas are applied.

Row-count consistency is the codec's (protos/codec.py step_request_from_pb); here what needs the
service's state: the pool's epoch, its block count, the model's vocabulary and context, the tables
the service holds. Malformed values are NanoKVError (INVALID_ARGUMENT), a wrong epoch StaleEpoch and
a sequence without a table PreconditionError (FAILED_PRECONDITION).
"""

from __future__ import annotations

from typing import Any

from nanokv.errors import NanoKVError, PreconditionError, StaleEpoch
from nanokv.messages import PLACEHOLDER, StepRequest

MAX_STEPS_AHEAD = 4  # a pipelining gateway has at most one step in flight beyond the one running


def validate_step(svc: Any, req: StepRequest, *, in_turn: bool = True) -> None:
    """svc: a ComputeService (model_config, runner, _tables, _next_step). in_turn False: only what
    can be judged before the step's turn comes (epoch, step id window), not the tables."""
    epoch = svc.runner.pool_epoch
    if not epoch:
        raise StaleEpoch(req.epoch, 0, "no KV pool is mapped (the cache service is gone); retry after it is back")
    if req.epoch and req.epoch != epoch:
        raise StaleEpoch(req.epoch, epoch)
    if not svc._next_step <= req.step_id <= svc._next_step + MAX_STEPS_AHEAD:
        raise PreconditionError("step_id", f"got step {req.step_id}; expected {svc._next_step} (or up to "
                                           f"{MAX_STEPS_AHEAD} ahead while it runs)")
    if not in_turn:
        return
    vocab = svc.model_config.vocab_size
    num_blocks = svc.runner.num_blocks
    block_size = svc.runner.block_size
    max_len = svc.max_model_len
    max_table = -(-max_len // block_size)
    if len(set(req.seq_ids)) != len(req.seq_ids):
        raise NanoKVError("seq_ids", "a sequence appears in two rows")
    for t in req.tokens:
        if not (0 <= t < vocab or t == PLACEHOLDER):
            raise NanoKVError("tokens", f"token id {t} out of range; allowed: [0, {vocab}) or {PLACEHOLDER}")
    sampled = svc._last[1] if svc._last is not None else {}  # the previous step's samples (placeholders)
    off = 0
    for seq_id, start, n in zip(req.seq_ids, req.num_computed, req.num_new):
        row, off = req.tokens[off:off + n], off + n
        if PLACEHOLDER in row[:-1] or (row[-1] == PLACEHOLDER and seq_id not in sampled):
            raise NanoKVError("tokens", f"sequence {seq_id}: {PLACEHOLDER} stands only for the previous step's "
                                        f"sample of this sequence, as its row's last token")
        if start + n > max_len:
            raise NanoKVError("num_new", f"sequence {seq_id}: {start} + {n} tokens exceed the context of {max_len}")
    # block sparsity: -1 is a hole, -2 - j slot j of hybrid's demotion store (nanokv.kv.demote)
    sparsity = getattr(svc, "sparsity", None)
    store = sparsity.store if sparsity is not None else None
    low = 0 if sparsity is None else -1 if store is None else -1 - store.num_slots
    if sparsity is None and req.demotions:
        raise NanoKVError("demotions", "this compute service runs without block sparsity (compression_sparsity 0)")
    if sparsity is not None:
        _check_sparse(req, svc._tables, block_size, num_blocks, store.num_slots if store is not None else 0)
    lengths = {s: len(t) for s, t in svc._tables.items()}  # after this step's forgets and deltas
    for seq_id in (*req.finished, *req.preempted):
        lengths.pop(seq_id, None)
    for d in req.tables:
        if d.start < 0 or d.start > lengths.get(d.seq_id, 0):
            raise NanoKVError("tables.start", f"sequence {d.seq_id}: start {d.start} is past its table of "
                                              f"{lengths.get(d.seq_id, 0)} blocks")
        if d.start + len(d.blocks) > max_table:
            raise NanoKVError("tables.blocks", f"sequence {d.seq_id}: more than {max_table} blocks")
        for b in d.blocks:
            if not low <= b < num_blocks:
                raise NanoKVError("tables.blocks", f"block id {b} out of range; allowed: [0, {num_blocks})" + (
                    f", -1 (a hole) or a demotion-store code down to {low}" if low < 0 else ""))
        lengths[d.seq_id] = d.start + len(d.blocks)
    params = set(svc._params) | {s for s, _ in req.new_seqs}
    params -= set(req.finished)
    for r, (seq_id, start, n) in enumerate(zip(req.seq_ids, req.num_computed, req.num_new)):
        have = lengths.get(seq_id)
        if have is None:
            raise PreconditionError("seq_ids", f"sequence {seq_id} has no block table here")
        if have * block_size < start + n:
            raise NanoKVError("tables", f"sequence {seq_id}: {have} blocks cannot hold {start + n} tokens")
        if r in req.sample_rows and seq_id not in params:
            raise PreconditionError("new_seqs", f"sequence {seq_id} samples but its sampling params never came")


def _check_sparse(req: StepRequest, tables: dict[int, list[int]], block_size: int, num_blocks: int,
                  num_slots: int) -> None:
    """Block sparsity: the demotions name pool blocks and store slots, and every row writes its new
    tokens into pool blocks (never a hole or a demoted entry: only full blocks are sparsified)."""
    for b, j in req.demotions:
        if not 0 <= b < num_blocks or not 0 <= j < num_slots:
            raise NanoKVError("demotions", f"({b}, {j}): allowed blocks [0, {num_blocks}), slots [0, {num_slots})")
    deltas = {d.seq_id: d for d in req.tables}
    for seq_id, start, n in zip(req.seq_ids, req.num_computed, req.num_new):
        d = deltas.get(seq_id)
        t = tables.get(seq_id, []) if seq_id not in req.preempted else []
        if d is not None:
            t = t[:d.start] + d.blocks
        for i in range(start // block_size, min(len(t), (start + n - 1) // block_size + 1)):
            if t[i] < 0:
                raise NanoKVError("tables", f"sequence {seq_id}: its tokens {start}..{start + n - 1} would be "
                                            f"written to entry {i}, which is {t[i]}, not a pool block")
