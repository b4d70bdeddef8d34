"""A launched step's sampled ids on their way to the host: the Launched handle launch returns and
collect waits on, and the pinned host buffers the ids are copied into without blocking the launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nanokv.messages import StepResult


@dataclass
class Launched:
    """A step whose sampled ids the host may not have yet."""
    step_id: int
    result: StepResult | None  # ready (synchronous sampling: logprobs wanted, or nothing sampled)
    host: torch.Tensor | None = None  # [n] int64, valid once `event` completes
    event: Any = None  # torch.cuda.Event on CUDA
    block_scores: list[tuple[int, list[float]]] = field(default_factory=list)  # StepResult.block_scores

    def wait(self) -> StepResult:
        """The step's result, once its copy to the host is complete."""
        if self.result is not None:
            return self.result
        if self.event is not None:
            self.event.synchronize()
        assert self.host is not None  # a launch without a result always has its host copy
        return StepResult(self.step_id, self.host.tolist(), block_scores=self.block_scores)


class HostCopies:
    """Two alternating pinned host buffers: step N+1's ids are copied into one while the host may
    still read step N's from the other."""

    def __init__(self, min_size: int):
        self.min_size = min_size  # allocated at least this large, so batch growth rarely reallocates
        self._pinned: list[torch.Tensor] = []
        self._flip = 0

    def to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying `tokens` to the host; returns the host view and the CUDA event that marks the
        copy done (CPU tensors: themselves, no event)."""
        if not tokens.is_cuda:
            return tokens, None
        n = tokens.shape[0]
        if not self._pinned or self._pinned[0].shape[0] < n:
            size = max(n, self.min_size)
            self._pinned = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._flip ^= 1
        host = self._pinned[self._flip][:n]
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event
