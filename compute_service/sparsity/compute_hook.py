"""Block sparsity, the compute service's part: measure, and copy what the cache service demotes.

The cache service decides which blocks go (nanokv.cache_service.sparsity.decide); here:
  - attention / hybrid: the attention probe (probe.py) measures each step's attention mass per
    block; `scores` reduces it per row by the policy's score_mode into StepResult.block_scores, which
    the gateway relays to the cache service with the next plan (no extra call);
  - hybrid: the INT4 demotion store's tensors (nanokv.kv.demote) sit beside the int8 layers; a step
    request's `demotions` (pool block, slot) are copied INT8 -> INT4 first thing in the step, before
    the forward pass may write those blocks again (the cache service gave them back to the pool).
    The store's free list is the cache service's (DemotionSlots): the same size by the same rule.
With s = 0 the compute service builds none of this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nanokv.errors import ConfigError, NanoKVError
from nanokv.sparsity import SparsityParams, demotion_slots

if TYPE_CHECKING:
    from nanokv.compute_service.sparsity.probe import AttentionProbe
    from nanokv.kv.demote import DemotionStore


class ComputeSparsity:
    def __init__(self, params: SparsityParams, runner: Any) -> None:
        self.params = params
        self.runner = runner
        self.probe: AttentionProbe | None = None
        if params.needs_scores:
            from nanokv.compute_service.sparsity.probe import AttentionProbe

            self.probe = AttentionProbe(window=params.probe_window)
            runner.attn_probe = self.probe
        self.store: DemotionStore | None = None
        if params.demotes:
            from nanokv.kv.demote import DemotionStore

            # ConfigError unless every layer is int8; slots: what the cache service's free list holds
            self.store = DemotionStore(runner.kv_caches, demotion_slots(params, runner.num_blocks))
            runner.demotion_store = self.store

    def demote(self, moves: Sequence[tuple[int, int]]) -> None:
        """(pool block, slot) pairs, in order: each block copied INT8 -> INT4 into its slot."""
        if not moves:
            return
        if self.store is None:
            raise NanoKVError("demotions", "this compute service keeps no demotion store (sparsity_policy is not "
                                           "hybrid here)")
        n, m = self.runner.num_blocks, self.store.num_slots
        for b, j in moves:
            if not 0 <= b < n or not 0 <= j < m:
                raise NanoKVError("demotions", f"({b}, {j}): allowed blocks 0..{n - 1}, slots 0..{m - 1}")
        blocks, slots = [b for b, _ in moves], [j for _, j in moves]
        if len(set(slots)) == len(slots):
            self.store.demote(blocks, slots)  # one batched copy per layer
        else:  # a slot freed and taken again since the last step: in order, the last copy wins
            for b, j in moves:
                self.store.demote([b], [j])

    def scores(self, seq_ids: Sequence[int]) -> list[tuple[int, list[float]]]:
        """This step's attention mass per block, per row that the probe measured: (seq_id, mass).
        Empty without the probe, or when the step ran without it (a CUDA-graph step)."""
        if self.probe is None:
            return []
        out = []
        for seq_id, mass in zip(seq_ids, self.probe.take()):
            if mass is not None:
                mx, sm = mass
                out.append((seq_id, (mx if self.params.score_mode == "max" else sm).tolist()))
        return out


def attach(cfg: Any, runner: Any) -> ComputeSparsity | None:
    """The compute service's sparsity for its config (a ComputeConfig), or None when s is 0."""
    params = cfg.sparsity_params
    if params is None:
        return None
    if params.needs_scores and cfg.tensor_parallel_size > 1:
        raise ConfigError("sparsity_policy", f"{params.policy!r} needs the attention probe, which is not wired "
                                             "for tensor parallelism yet; use streaming or interval")
    backend = getattr(runner.backend, "name", "torch")
    if params.demotes and backend not in ("torch", "triton"):
        raise ConfigError("attention_backend", f"hybrid sparsity reads the INT4 demotion store on the 'torch' and "
                                               f"'triton' backends; got {backend!r}")
    device = getattr(runner, "device", None)
    captures = getattr(runner, "graphs", None) is not None or (
        device is not None and device.type == "cuda" and not cfg.enforce_eager)
    if params.demotes and backend == "torch" and captures:
        # the torch reference selects a step's demoted entries (data-dependent shapes): not capturable
        raise ConfigError("enforce_eager", "hybrid sparsity on attention_backend='torch' needs eager decode steps: "
                                           "set enforce_eager=True, or use attention_backend='triton'")
    sp = ComputeSparsity(params, runner)
    if sp.probe is not None and captures:
        sp.probe.decode_rows = False  # as in the graph steps, which do not run the probe
    if sp.store is not None and backend == "triton" and device is not None and device.type == "cuda":
        from nanokv.kernels.triton_demote import demote_blocks

        sp.store.write_layer = demote_blocks  # one launch per layer instead of ~20 torch ops
    if sp.store is not None and getattr(runner, "graphs", None) is not None:
        # a runner that captured before this call (the compute service attaches first, so its graphs
        # are captured once): those launches read the plain int8 layers. Captured again on the hybrid
        # layers (nanokv.kernels.triton_hybrid: one launch per layer whatever the table holds, the
        # store's tensors fixed from here on, so the graphs stay valid)
        runner.graphs = None
        runner.capture_cudagraphs(runner._graph_model_len)
    return sp
