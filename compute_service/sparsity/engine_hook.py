"""Block sparsity inside the engine: one call per step, after the scheduler published the step's
blocks (Scheduler.update) and before sampling.

For every sequence that ran this step it measures the pool blocks the sequence holds (entries >= 0
of its block table: the step's peak, new blocks included), folds the step's attention mass into
the sequence's scores (attention / hybrid), then applies the policy's plan through the cache
manager: dropped blocks go back to the pool (KVCacheManager.drop_blocks: -1 holes, nothing after
the first hole is published); demoted blocks (hybrid) are copied as INT4 into a slot of the
demotion store (nanokv.kv.demote), then their INT8 block goes back to the pool and the entry
becomes -2 - slot (KVCacheManager.replace_with_external). The manager hands every slot back to the
store when its sequence drops the entry, finishes, is aborted or preempted. With s = 0 the engine
gets no EngineSparsity at all.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from nanokv.compute_service.sparsity.policies import SparsityParams
from nanokv.compute_service.sparsity.state import SequenceSparsity
from nanokv.errors import ConfigError

if TYPE_CHECKING:
    from nanokv.compute_service.sparsity.probe import AttentionProbe
    from nanokv.kv.demote import DemotionStore

_KEEP_PEAKS = 4096  # per-request peaks remembered (most recent requests)


class EngineSparsity:
    def __init__(self, params: SparsityParams, cache_manager: Any, runner: Any) -> None:
        self.params = params
        self.cm = cache_manager
        self.runner = runner
        self.block_size = cache_manager.block_size
        self._states: dict[Hashable, tuple[list[int], SequenceSparsity]] = {}
        self.peak_blocks: OrderedDict[str, int] = OrderedDict()  # request id -> most pool blocks held at once
        self.blocks_dropped = 0
        self.blocks_demoted = 0  # block demotions (each covers every layer)
        # demotions not done this step (the block stays INT8, retried next step): the block is shared
        # with another sequence (a prefix hit: moving it would free nothing) / the store was full
        self.demotions_refused = 0
        self.demotions_store_full = 0
        self.probe: AttentionProbe | None = None
        if params.needs_scores:
            from nanokv.compute_service.sparsity.probe import AttentionProbe

            self.probe = AttentionProbe()
            runner.attn_probe = self.probe
        self.store: DemotionStore | None = None
        if params.demotes:
            from nanokv.kv.demote import DemotionStore

            slots = max(1, math.ceil(params.store_fraction * cache_manager.num_blocks))
            self.store = DemotionStore(runner.kv_caches, slots)  # ConfigError unless every layer is int8
            runner.demotion_store = self.store
            cache_manager.set_external_release(self.store.release_code)

    def _state(self, seq_id: Hashable) -> SequenceSparsity:
        table = self.cm.block_table(seq_id)
        entry = self._states.get(seq_id)
        if entry is None or entry[0] is not table:  # new, or re-allocated after a preemption
            entry = (table, SequenceSparsity(self.params, self.block_size))
            self._states[seq_id] = entry
        return entry[1]

    def after_step(self, scheduled: list[Any]) -> None:
        """scheduled: the step's ScheduledSeq list, in the runner's row order."""
        masses = self.probe.take() if self.probe is not None else []
        for row, item in enumerate(scheduled):
            seq = item.seq
            if not self.cm.has_seq(seq.seq_id):
                continue
            table = self.cm.block_table(seq.seq_id)
            held = sum(1 for b in table if b >= 0)
            rid = seq.request_id
            self.peak_blocks[rid] = max(self.peak_blocks.pop(rid, 0), held)
            st = self._state(seq.seq_id)
            mass = masses[row] if row < len(masses) else None  # None: the probe did not run (graph step)
            if mass is not None:
                mx, sm = mass
                st.observe((mx if self.params.score_mode == "max" else sm).tolist())
            self._apply(seq.seq_id, st, seq.num_computed_tokens)
        while len(self.peak_blocks) > _KEEP_PEAKS:
            self.peak_blocks.popitem(last=False)
        if len(self._states) > 2 * len(scheduled) + 64:  # forget finished sequences now and then
            self._states = {k: v for k, v in self._states.items() if self.cm.has_seq(k)}

    def _apply(self, seq_id: Hashable, st: SequenceSparsity, num_computed: int) -> None:
        plan = st.plan(num_computed)
        if not plan:
            return
        if plan.drop:
            self.cm.drop_blocks(seq_id, plan.drop)
            self.blocks_dropped += len(plan.drop)
        done = self._demote(seq_id, plan.demote) if plan.demote and self.store is not None else []
        st.commit(plan.drop, done)

    def _demote(self, seq_id: Hashable, logical: list[int]) -> list[int]:
        """Move these blocks into the INT4 store; returns the logical indices really moved."""
        from nanokv.kv.demote import code

        assert self.store is not None
        alone = self.cm.held_alone(seq_id, logical)
        self.demotions_refused += len(logical) - len(alone)
        slots = self.store.take(len(alone))
        self.demotions_store_full += len(alone) - len(slots)
        done = alone[:len(slots)]
        table = self.cm.block_table(seq_id)
        self.store.demote([table[i] for i in done], slots)  # copy first: the release may hand b out
        for i, j in zip(done, slots):
            self.cm.replace_with_external(seq_id, i, code(j))
        self.blocks_demoted += len(done)
        return done

    def stats(self) -> dict[str, Any]:
        return {"policy": self.params.policy, "sparsity": self.params.sparsity,
                "blocks_dropped": self.blocks_dropped, "blocks_demoted": self.blocks_demoted,
                "demotions_refused": self.demotions_refused, "demotions_store_full": self.demotions_store_full,
                "demotion_slots": self.store.num_slots if self.store is not None else 0,
                "demotion_slots_free": self.store.num_free() if self.store is not None else 0,
                "max_peak_blocks": max(self.peak_blocks.values(), default=0)}


def attach(cfg: Any, cache_manager: Any, runner: Any) -> EngineSparsity | None:
    """The engine's sparsity for this config, or None when compression_sparsity is 0. The policy's
    knobs default to nanokv.compute_service.sparsity.policies.SparsityParams; an EngineConfig built in code may set
    them in cfg.extra["sparsity"] (e.g. {"recent_blocks": 4}), the one place EngineConfig leaves open."""
    s = float(cfg.compression_sparsity)
    if s <= 0.0:
        return None
    knobs = dict((getattr(cfg, "extra", None) or {}).get("sparsity", {}))  # sink_blocks, recent_blocks, score_mode
    try:
        params = SparsityParams(s, cfg.sparsity_policy, **knobs)
    except (TypeError, ValueError) as e:
        raise ConfigError("extra.sparsity", str(e)) from None
    if params.needs_scores and cfg.tensor_parallel_size > 1:
        raise ConfigError("sparsity_policy", f"{params.policy!r} needs the attention probe, which is not wired "
                                             "for tensor parallelism yet; use streaming or interval")
    if params.demotes and getattr(runner.backend, "name", "torch") != "torch":
        raise ConfigError("sparsity_policy", "hybrid reads demoted blocks from the INT4 demotion store, which "
                                             "only the torch reference does for now; use attention_backend='torch'")
    if params.demotes and getattr(runner, "graphs", None) is not None:
        # the store read selects the demoted entries of a step's tables (data-dependent shapes): not capturable
        raise ConfigError("sparsity_policy", "hybrid needs eager decode steps; set enforce_eager=True")
    return EngineSparsity(params, cache_manager, runner)
