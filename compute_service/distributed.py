"""Tensor-parallel state and the two collectives the model needs.

Layers read `get_tp_rank()` / `get_tp_size()` when they are built (to size their shards) and call
`all_reduce` / `all_gather` in forward. At tp_size == 1 the collectives are no-ops, so the single
process path never touches torch.distributed. A TP worker calls `init_tensor_parallel(rank, size)`
after `torch.distributed.init_process_group`; `tp_state(rank, size)` sets the state temporarily,
which lets a single process build one rank's shards (to load or inspect them) without a group.
`head_ranges` decides which attention heads a rank holds (uneven splits included).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from nanokv.errors import NanoKVError


@dataclass
class TPState:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup, or None for the default group


_STATE = TPState()
HeadRange = tuple[int, int]  # (first head, number of heads)


def _check(rank: int, size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise NanoKVError("tensor_parallel_size", f"got {size!r}; must be an integer >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise NanoKVError("tp_rank", f"got {rank!r}; must be in [0, {size})")


def init_tensor_parallel(rank: int, size: int, group: Any = None) -> None:
    """Set this process's TP rank and size (call after init_process_group when size > 1)."""
    global _STATE
    _check(rank, size)
    _STATE = TPState(rank, size, group)


@contextmanager
def tp_state(rank: int, size: int, group: Any = None) -> Iterator[TPState]:
    """Temporarily act as `rank` of `size` (used while building and loading one rank's model)."""
    global _STATE
    _check(rank, size)
    prev = _STATE
    _STATE = TPState(rank, size, group)
    try:
        yield _STATE
    finally:
        _STATE = prev


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.size


def _require_group() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"tensor parallel size is {_STATE.size} but torch.distributed is not initialised; "
            "call torch.distributed.init_process_group and init_tensor_parallel first"
        )


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, count) of run `index` when n items are cut into `parts` contiguous runs, the first
    n % parts runs one longer: split_range(3, 2, 0) == (0, 2), split_range(3, 2, 1) == (2, 1)."""
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (index < extra)


def head_ranges(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> tuple[HeadRange, HeadRange]:
    """((first query head, count), (first kv head, count)) that TP `rank` of `tp_size` holds.

    Heads are dealt out by GQA group, so every rank's query heads use only its own kv heads:
      * tp <= kv heads: each rank takes a contiguous run of kv heads with all their query heads
        (SmolLM2, 9 q / 3 kv at tp 2: rank 0 kv 0-1 + q 0-5, rank 1 kv 2 + q 6-8);
      * tp > kv heads: the ranks are dealt out over the kv heads, each kv head is replicated on its
        ranks and they split its query heads (9 q / 3 kv at tp 4: rank 0 q 0-1, rank 1 q 2, both
        with kv 0; rank 2 q 3-5 + kv 1; rank 3 q 6-8 + kv 2).
    Earlier ranks never hold fewer heads than later ones, so rank 0's cache is the largest.
    Impossible only when tp > num_heads (a rank would hold no query head).
    """
    _check(rank, tp_size)
    if num_heads % num_kv_heads:
        raise NanoKVError("num_key_value_heads", f"{num_kv_heads} does not divide num_attention_heads {num_heads}")
    if tp_size > num_heads:
        raise NanoKVError("tensor_parallel_size", f"{tp_size} is more than num_attention_heads {num_heads}: "
                          "some rank would hold no attention head")
    group = num_heads // num_kv_heads
    if tp_size <= num_kv_heads:
        kv0, nkv = split_range(num_kv_heads, tp_size, rank)
        return (kv0 * group, nkv * group), (kv0, nkv)
    for kv in range(num_kv_heads):
        r0, nranks = split_range(tp_size, num_kv_heads, kv)
        if rank < r0 + nranks:
            q0, nq = split_range(group, nranks, rank - r0)  # nranks <= group since tp <= num_heads
            return (kv * group + q0, nq), (kv, 1)
    raise AssertionError("unreachable")


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks in place (no-op at tp_size 1). Returns `x`."""
    if _STATE.size == 1:
        return x
    import torch.distributed as dist

    _require_group()
    dist.all_reduce(x, group=_STATE.group)
    return x


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Overwrite `x` on every TP rank with rank 0's (no-op at tp_size 1). Returns `x`."""
    if _STATE.size == 1:
        return x
    import torch.distributed as dist

    _require_group()
    dist.broadcast(x, src=0, group=_STATE.group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` in rank order (identity at tp_size 1)."""
    if _STATE.size == 1:
        return x
    import torch.distributed as dist

    _require_group()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x, group=_STATE.group)
    return torch.cat(parts, dim=dim)
