"""What a compute service in its own process does for a gateway's adaptive controller.

In process the controller's actuators reach into the runner (nanokv.compute_service.adaptive.precision,
.pool); across processes the gateway only has RPCs, so the compute service itself keeps the
KV-width error probe (read by Compute.ProbeErrors), reports what a block costs (Compute.Stats)
and refuses a pool change the device cannot hold (Compute.Repool) before it drops anything.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from nanokv.compute_service.error_probe import ErrorProbe, probe_widths
from nanokv.compute_service.kv_hooks import LayerHooks
from nanokv.errors import PreconditionError
from nanokv.kv.cache import bytes_per_block
from nanokv.kv.demote import HybridInt8KV

log = logging.getLogger(__name__)


def make_error_probe(cfg: Any, runner: Any) -> ErrorProbe | None:
    """The probe a compute service in its own process keeps for a gateway's KV-width rule: every
    layer planned below 16 bits is measured at each width from its planned one up to 8 (as the
    in-process PrecisionActuator does). None when that rule is off: adaptive off, no compressed
    layer, or hybrid sparsity's demotion store. Under tensor parallelism it measures rank 0's KV
    heads (the most of any rank), and a width change goes to every rank through Compute.Repool."""
    bits = list(getattr(runner, "layer_bits", []))
    if not cfg.adaptive or not any(b < 16 for b in bits):
        return None
    if any(isinstance(c, HybridInt8KV) for c in runner.kv_caches):
        log.warning("adaptive: no KV-width error probe with hybrid sparsity")
        return None
    probe = ErrorProbe(probe_widths(bits))
    attach_error_probe(probe, runner.layer_hooks)
    return probe


def attach_error_probe(probe: ErrorProbe, layer_hooks: list[LayerHooks]) -> None:
    """Hook ``probe`` into the layers it measures (also after a repool, at any width: a layer backed
    off to 16 bits is still measured at its narrower widths, so the rule can narrow it again)."""
    for i in probe.widths:
        layer_hooks[i].probe = probe


def kv_bytes_per_block(runner: Any) -> int:
    """One block in every layer at its current width (what a pool grow costs per block; under tensor
    parallelism rank 0's, the largest; 0 where the runner does not say)."""
    if not hasattr(runner, "head_dim") or not hasattr(runner, "kv_caches"):
        return 0
    return sum(bytes_per_block(c.bits, c.num_kv_heads, c.block_size, runner.head_dim, runner.dtype)
               for c in runner.kv_caches)


def memory_shortfall(device: Any, need: int, margin_bytes: int) -> str:
    """Why ``need`` more bytes do not fit on a CUDA device with ``margin_bytes`` left free ('' if they
    do): the rule every KV growth keeps (a repool here, an in-process pool grow or KV widening)."""
    free = torch.cuda.mem_get_info(device)[0]
    if need <= free - margin_bytes:
        return ""
    return (f"needs {need / 2**20:.0f} MiB of device memory; {free / 2**20:.0f} MiB are free and "
            f"adaptive_pool_margin_bytes ({margin_bytes / 2**20:.0f} MiB) stay free")


def check_repool_memory(cfg: Any, runner: Any, num_blocks: int, bits: list[int]) -> None:
    """Refuse (PreconditionError, nothing changed) a larger CUDA pool than the device can hold now.
    The old pool's memory stays reserved in the cache service's allocator, so a larger pool needs
    all of its bytes free, less ``adaptive_pool_margin_bytes``; a smaller one reuses the old."""
    if runner.device.type != "cuda":
        return
    c = runner.kv_caches[0]
    need = num_blocks * sum(bytes_per_block(b, c.num_kv_heads, c.block_size, runner.head_dim, runner.dtype)
                            for b in bits)
    if need <= runner.num_blocks * kv_bytes_per_block(runner):
        return
    why = memory_shortfall(runner.device, need, cfg.adaptive_pool_margin_bytes)
    if why:
        raise PreconditionError("repool", f"the new pool {why}")
