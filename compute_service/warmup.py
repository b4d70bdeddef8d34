"""Start-up warm-up of the compute service: what would otherwise load on first use, inside a step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nanokv.compute_service.service import ComputeService


def warm_logits(svc: ComputeService) -> None:
    """The LM head and the greedy pick for every row count a step can sample (1 .. max_num_seqs).
    The head's GEMM runs eagerly on the step's sampling rows, a new count in almost every prefill
    step and as decodes finish; the first use of each of cuBLAS's kernels for those shapes loads it,
    host time inside a step (docs/kernels.md). One rank only: with tensor parallelism the head
    gathers across ranks."""
    if svc.device.type != "cuda" or svc.config.tensor_parallel_size != 1:
        return
    model = svc.runner.model
    dtype = next(model.parameters()).dtype
    hidden = torch.zeros(svc.config.max_num_seqs, svc.model_config.hidden_size, dtype=dtype, device=svc.device)
    with torch.inference_mode():
        for m in range(1, hidden.shape[0] + 1):
            model.compute_logits(hidden[:m], False).argmax(dim=-1)
    torch.cuda.synchronize(svc.device)
