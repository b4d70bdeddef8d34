"""The per-step message rank 0 broadcasts to tensor-parallel workers: two int64 tensors, no pickle.

A step is the ModelRunner's `items` list, (token_ids, num_computed, num_new, block_table,
is_prefill) per sequence, plus which rows need logits. Only what a worker cannot know is sent:
the `num_new` tokens each sequence computes this step (earlier tokens already live in every rank's
KV cache, so whole prompts never travel twice) and the block tables. Wire layout:

  header  [op, B, n_tokens, n_table, n_rows, flags]                      (fixed size)
          flags: all logits, no logits rows, fed (async scheduling: some input tokens are the
          previous step's samples, still on rank 0's device; the step's input ids follow from rank
          0 over the data group, nanokv.compute_service.distributed.broadcast_from_rank0)
  payload [B x (start, num_new, is_prefill, table_len, seq_len)] ++ new tokens ++ block tables
          ++ logits rows                                                 (one int64 tensor)

On a worker each sequence's token_ids becomes a TokenWindow: it answers for positions
[start, start + num_new) and refuses any other, so a runner change that starts reading older
tokens fails loudly instead of computing on garbage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch
import torch.distributed as dist

OP_STEP, OP_STOP, OP_CALL = 1, 2, 3
_HEADER = 6
_COLS = 5  # per-sequence columns: start, num_new, is_prefill, table_len, seq_len
_ALL_LOGITS, _ROWS_NONE, _FED = 1, 2, 4  # flag bits


class TokenWindow(Sequence[int]):
    """Token ids [start, start + len(tokens)) of a sequence of `length` tokens."""

    def __init__(self, start: int, tokens: list[int], length: int):
        self.start, self.tokens, self.length = start, tokens, length

    def __len__(self) -> int:
        return self.length

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        end = self.start + len(self.tokens)
        if isinstance(i, slice):
            lo, hi, step = i.indices(self.length)
            if hi <= lo:
                return []
            if step != 1 or lo < self.start or hi > end:
                raise IndexError(self._refuse(f"[{lo}:{hi}:{step}]"))
            return self.tokens[lo - self.start:hi - self.start]
        j = i + self.length if i < 0 else i
        if not self.start <= j < end:
            raise IndexError(self._refuse(f"[{i}]"))
        return self.tokens[j - self.start]

    def _refuse(self, what: str) -> str:
        return (f"token_ids{what}: a tensor-parallel worker only receives positions "
                f"[{self.start}, {self.start + len(self.tokens)}) of this step's sequence")


@dataclass
class Step:
    items: list[tuple[Any, int, int, list[int], bool]]
    logits_rows: list[int] | None
    all_logits: bool
    fed: bool = False  # every rank takes rank 0's input ids (ModelRunner.execute(ids_from_rank0=True))


def _encode(items, logits_rows: list[int] | None, all_logits: bool,
            fed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    B = len(items)
    meta = np.empty((B, _COLS), dtype=np.int64)
    tokens: list[int] = []
    tables: list[int] = []
    for r, (token_ids, start, n, table, is_prefill) in enumerate(items):
        meta[r] = (start, n, bool(is_prefill), len(table), len(token_ids))
        tokens.extend(token_ids[start:start + n])
        tables.extend(table)
    rows = list(logits_rows) if logits_rows is not None else []
    flags = (_ALL_LOGITS if all_logits else 0) | (_ROWS_NONE if logits_rows is None else 0) | (_FED if fed else 0)
    header = torch.tensor([OP_STEP, B, len(tokens), len(tables), len(rows), flags], dtype=torch.int64)
    payload = np.concatenate([meta.ravel(), np.asarray(tokens, dtype=np.int64),
                              np.asarray(tables, dtype=np.int64), np.asarray(rows, dtype=np.int64)])
    return header, torch.from_numpy(payload)


def _decode(header: list[int], payload: torch.Tensor) -> Step:
    _, B, n_tok, n_tab, n_rows, flags = header
    flat = payload.tolist()
    meta = [flat[i * _COLS:(i + 1) * _COLS] for i in range(B)]
    tok_at, tab_at, rows_at = B * _COLS, B * _COLS + n_tok, B * _COLS + n_tok + n_tab
    items = []
    for start, n, is_prefill, table_len, seq_len in meta:
        tokens = flat[tok_at:tok_at + n]
        table = flat[tab_at:tab_at + table_len]
        tok_at, tab_at = tok_at + n, tab_at + table_len
        items.append((TokenWindow(start, tokens, seq_len), start, n, table, bool(is_prefill)))
    rows = None if flags & _ROWS_NONE else flat[rows_at:rows_at + n_rows]
    return Step(items, rows, bool(flags & _ALL_LOGITS), bool(flags & _FED))


def send_step(group: Any, items, logits_rows: list[int] | None, all_logits: bool, fed: bool = False) -> None:
    """Rank 0: broadcast one step (the workers are blocked in `recv`)."""
    header, payload = _encode(items, logits_rows, all_logits, fed)
    dist.broadcast(header, src=0, group=group)
    if payload.numel():  # an empty step carries no payload (gloo refuses empty broadcasts)
        dist.broadcast(payload, src=0, group=group)


def send_stop(group: Any) -> None:
    """Rank 0: tell the workers to leave their loop."""
    dist.broadcast(torch.tensor([OP_STOP, 0, 0, 0, 0, 0], dtype=torch.int64), src=0, group=group)


def send_call(group: Any, method: str, args: tuple, kwargs: dict[str, Any]) -> None:
    """Rank 0: have every worker call `runner.method(*args, **kwargs)` (rare: warm-up, capture)."""
    dist.broadcast(torch.tensor([OP_CALL, 0, 0, 0, 0, 0], dtype=torch.int64), src=0, group=group)
    dist.broadcast_object_list([(method, args, kwargs)], src=0, group=group)


def recv(group: Any) -> Step | tuple[str, tuple, dict[str, Any]] | None:
    """Worker: wait for rank 0's next message: a Step, a (method, args, kwargs) call, or None (stop)."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    h = header.tolist()
    if h[0] == OP_STOP:
        return None
    if h[0] == OP_CALL:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]
    if h[0] != OP_STEP:
        raise RuntimeError(f"tensor-parallel worker got an unknown message {h}")
    payload = torch.empty(h[1] * _COLS + h[2] + h[3] + h[4], dtype=torch.int64)
    if payload.numel():
        dist.broadcast(payload, src=0, group=group)
    return _decode(h, payload)
