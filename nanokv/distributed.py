"""Tensor-parallel state and the two collectives the model needs.

Layers read `get_tp_rank()` / `get_tp_size()` when they are built (to size their shards) and call
`all_reduce` / `all_gather` in forward. At tp_size == 1 the collectives are no-ops, so the single
process path never touches torch.distributed. A TP worker calls `init_tensor_parallel(rank, size)`
after `torch.distributed.init_process_group`; `tp_state(rank, size)` sets the state temporarily,
which lets a single process build one rank's shards (to load or inspect them) without a group.
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


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks in place (no-op at tp_size 1). Returns `x`."""
    if _STATE.size == 1:
        return x
    import torch.distributed as dist

    _require_group()
    dist.all_reduce(x, group=_STATE.group)
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
