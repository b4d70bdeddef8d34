"""AdaptiveController: the engine loop's self-tuning, one call per step.

    ctl = AdaptiveController(settings, cache=cm, scheduler=sched, precision=actuator, pool=pool_actuator)
    ... after every engine step:  ctl.on_step(scheduler_output)

Every ``window_steps`` steps it closes a window of figures (nanokv.gateway.adaptive.window), lets each rule
(nanokv.gateway.adaptive.rules) propose at most one change, and applies it ("act") or only reports it
("recommend"). Every decision is logged with its reason and counted in ``counts`` (exported as
``nanokv_adaptations_total{kind}``). Torch-free: the simulator runs it with a cache manager only;
the KV bit-width and pool rules reach torch only through the ``PrecisionControl`` /
``PoolControl`` they are handed.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from nanokv.cache_service.ghosts import GhostCaches
from nanokv.cache_service.hashing import hash_full_blocks
from nanokv.gateway.adaptive.pool_rule import PoolControl, PoolRule
from nanokv.gateway.adaptive.rules import ConcurrencyRule, PolicyRule, PrecisionRule, Proposal
from nanokv.gateway.adaptive.settings import AdaptiveSettings
from nanokv.gateway.adaptive.window import Counters, WindowMeter, WindowStats

if TYPE_CHECKING:
    from nanokv.gateway.scheduler import SchedulerOutput
    from nanokv.gateway.sequence import Sequence as Seq

log = logging.getLogger("nanokv.gateway.adaptive")


class PrecisionControl(Protocol):
    """What the KV bit-width rule needs from the torch side (nanokv.compute_service.adaptive.precision)."""

    base_bits: list[int]

    def current_bits(self) -> list[int]: ...

    def window_errors(self) -> dict[int, dict[int, float]]: ...

    def apply(self, changes: dict[int, int]) -> dict[int, str]:
        """Change layers' widths; returns {layer: why not} for the changes it refused."""
        ...


@dataclass(frozen=True)
class Decision:
    step: int
    kind: str
    action: str
    reason: str
    applied: bool
    note: str = ""  # why it was not applied (recommend mode, refused), if so


@dataclass(frozen=True)
class WindowRecord:
    """The state at the end of one window (for tests, plots and debugging)."""

    stats: WindowStats
    policy: str | None
    ghost_hit_ratios: dict[str, float] | None
    max_num_seqs: int | None
    layer_bits: tuple[int, ...] | None
    layer_errors: dict[int, dict[int, float]] | None
    num_blocks: int | None = None  # the KV pool at the window's end (after this window's decisions)


class AdaptiveController:
    def __init__(self, settings: AdaptiveSettings, *, cache: Any = None, scheduler: Any = None,
                 precision: PrecisionControl | None = None, pool: PoolControl | None = None,
                 policy_rule: bool = True, ghosts: Any = None,
                 concurrency_rule: bool = True, history: int = 4096) -> None:
        """ghosts: the policy rule's evidence kept elsewhere (nanokv.gateway.adaptive.remote: the cache
        service's ghost caches); None: GhostCaches in this process, fed from the scheduler's admissions."""
        if settings.mode not in ("act", "recommend"):
            raise ValueError(f"mode must be 'act' or 'recommend', got {settings.mode!r}")
        self.settings = settings
        self.cache = cache  # nanokv.cache_service.manager.KVCacheManager
        self.scheduler = scheduler  # nanokv.gateway.scheduler.Scheduler
        self.precision = precision
        self.ghosts: Any = None  # GhostCaches, or a remote view with the same window_scores / restart_recent
        self.policy_rule: PolicyRule | None = None
        if policy_rule and cache is not None and cache.enable_prefix_caching:
            if ghosts is None:
                cands = (*settings.policy_candidates, cache.policy_name)  # the active policy needs a ghost too
                ghosts = GhostCaches(cands, cache.num_blocks, cache.block_size, lru_k=cache.lru_k)
            self.ghosts = ghosts
            self.policy_rule = PolicyRule(settings)
        self.concurrency_rule = ConcurrencyRule(settings) if concurrency_rule and scheduler is not None else None
        self.precision_rule = PrecisionRule(settings) if precision is not None else None
        self.pool = pool
        self.pool_rule = PoolRule(settings) if pool is not None and cache is not None else None
        kinds = [r.kind for r in (self.policy_rule, self.concurrency_rule, self.precision_rule) if r is not None]
        kinds += self.pool_rule.kinds if self.pool_rule is not None else ()
        suffix = "_recommended" if settings.mode == "recommend" else ""
        # every key exists from the start: the metrics endpoint shows zeros, and a reader thread
        # copying the dict never sees it grow
        self.counts: dict[str, int] = {k + suffix: 0 for k in kinds}
        if self.precision_rule is not None:
            self.counts["kv_bits_refused"] = 0
        if self.pool_rule is not None and settings.mode == "act":
            self.counts.update(pool_grow_refused=0, pool_shrink_refused=0)
        self.decisions: deque[Decision] = deque(maxlen=256)
        self.history: deque[WindowRecord] = deque(maxlen=history)
        self.logit_error: dict[int, float] = {}  # layer -> last window's probe error at its current width
        self.step = 0
        self._computed = 0
        self._meter = WindowMeter(self._counters())
        self._admitted: dict[int, tuple[Seq, int]] = {}  # seq_id -> (sequence, preemptions at admission)
        self._recommended: dict[str, str] = {}

    # ---- inputs ---------------------------------------------------------------------------------
    def observe_request(self, block_hashes: Sequence[bytes]) -> None:
        """An admitted request's full-block hashes (the simulator calls this; the engine path
        derives it from the scheduler output in on_step)."""
        if self.ghosts is not None:
            self.ghosts.observe(block_hashes)

    def _observe_admissions(self, out: SchedulerOutput, ghosts: GhostCaches) -> None:
        cm = self.cache
        for item in out.prefills:
            seq = item.seq
            seen = self._admitted.get(seq.seq_id)
            if seen is not None and seen[1] == seq.num_preemptions:
                continue  # a later chunk of a prefill already observed
            self._admitted[seq.seq_id] = (seq, seq.num_preemptions)
            # The prompt is what the admission looked up (a re-admission after preemption also
            # carries the tokens generated so far: ignored, the ghosts only need the access pattern).
            # Capped like match_prefix: at least one token is always left to compute.
            prompt = seq.prompt_token_ids
            n = (len(prompt) - 1) // cm.block_size
            ghosts.observe(hash_full_blocks(prompt, cm.block_size, seq.cache_salt, cm.hash_algo, max_blocks=n))

    def _counters(self) -> Counters:
        sched = self.scheduler
        preemptions = sched.num_preemptions if sched is not None else (
            self.cache.stats.preemptions if self.cache is not None else 0)
        return Counters.read(self.step, self.cache.stats if self.cache is not None else None,
                             self._computed, preemptions)

    # ---- the loop -------------------------------------------------------------------------------
    def on_step(self, out: SchedulerOutput | None = None, computed_tokens: int | None = None) -> list[Decision]:
        """After every engine step (``out``: its SchedulerOutput, or None outside the scheduler).
        Returns the decisions taken at a window's end (usually none)."""
        self.step += 1
        if out is not None:
            if isinstance(self.ghosts, GhostCaches):  # (remote ghosts see the admissions themselves)
                self._observe_admissions(out, self.ghosts)
            self._computed += out.num_tokens if computed_tokens is None else computed_tokens
        elif computed_tokens:
            self._computed += computed_tokens
        sched = self.scheduler
        self._meter.sample(len(sched.running) if sched else 0, len(sched.waiting) if sched else 0,
                           self.cache.num_used_blocks() if self.cache is not None else 0)
        if self.step - self._meter.start.step < self.settings.window_steps:
            return []
        return self._close_window()

    def _close_window(self) -> list[Decision]:
        end = self._counters()
        w = self._meter.close(end, self.cache.num_blocks if self.cache is not None else 0)
        self._meter = WindowMeter(end)
        proposals: list[Proposal | None] = []
        ghosts = self.ghosts.window_scores() if self.ghosts is not None else None
        if self.policy_rule is not None:
            proposals.append(self.policy_rule.evaluate(w, ghosts, self.cache.policy_name))
            if self.policy_rule.phase_change and self.ghosts is not None:
                self.ghosts.restart_recent()
        if self.concurrency_rule is not None:
            proposals.append(self.concurrency_rule.evaluate(w, self.scheduler.max_num_seqs))
        errors = None
        if self.precision_rule is not None and self.precision is not None:
            errors = self.precision.window_errors()
            bits = self.precision.current_bits()
            for layer, errs in errors.items():
                self.logit_error[layer] = errs.get(bits[layer], 0.0)
            proposals.append(self.precision_rule.evaluate(errors, bits, self.precision.base_bits))
        if self.pool_rule is not None and self.pool is not None:
            proposals.append(self.pool_rule.evaluate(w, self.cache.num_blocks, self.pool.base_blocks,
                                                     self.pool.headroom_blocks, self._shrink_floor))
        decisions = [d for p in proposals if p is not None and (d := self._decide(p)) is not None]
        self.history.append(WindowRecord(
            w, self.cache.policy_name if self.cache is not None else None,
            ghosts[0].ratios if ghosts is not None else None,
            self.scheduler.max_num_seqs if self.scheduler is not None else None,
            tuple(self.precision.current_bits()) if self.precision is not None else None, errors,
            self.cache.num_blocks if self.cache is not None else None))
        self._prune_admitted()
        return decisions

    def _decide(self, p: Proposal) -> Decision | None:
        if self.settings.mode == "recommend":
            if self._recommended.get(p.kind) == p.action:
                return None  # the same advice again is no news; the state did not change
            self._recommended[p.kind] = p.action
            d = Decision(self.step, p.kind, p.action, p.reason, False, "recommend mode")
            key = p.kind + "_recommended"
        else:
            note = self._apply(p)
            d = Decision(self.step, p.kind, p.action, p.reason, not note, note)
            key = p.kind if not note else p.kind + "_refused"
        self.counts[key] = self.counts.get(key, 0) + 1
        self.decisions.append(d)
        verb = "applied" if d.applied else f"not applied ({d.note})"
        refused = not d.applied and self.settings.mode == "act"
        log.log(logging.WARNING if refused else logging.INFO,
                "adaptive %s %s at step %d: %s; because %s", d.kind, verb, d.step, d.action, d.reason)
        return d

    def _apply(self, p: Proposal) -> str:
        """Make the change; '' on success, else why not."""
        if p.kind == "eviction_policy":
            # keeps every cached block; warm: the new policy takes its ghost's order and history
            ghost = self.ghosts.caches.get(p.target) if self.ghosts is not None else None
            self.cache.set_policy(p.target, donor=ghost)
        elif p.kind == "max_num_seqs":
            self.scheduler.max_num_seqs = int(p.target)  # running sequences finish; no preemption
        elif p.kind == "kv_bits":
            assert self.precision is not None
            refused = self.precision.apply(p.target)
            if refused and len(refused) == len(p.target):
                return "; ".join(f"layer {i}: {why}" for i, why in refused.items())
            for i, why in refused.items():
                log.warning("adaptive kv_bits: layer %d not changed: %s", i, why)
        elif p.kind in ("pool_grow", "pool_shrink"):
            assert self.pool is not None
            before = self.cache.num_blocks
            got, why = self.pool.resize(int(p.target))
            if why or got == before:
                return why or f"the pool stayed at {before} blocks"
            if self.ghosts is not None:
                self.ghosts.resize(got)  # the ghosts model the live capacity
            if got != p.target:
                log.info("adaptive %s: stopped at %d blocks (asked %d): higher blocks are referenced",
                         p.kind, got, p.target)
        return ""

    def _shrink_floor(self) -> int:
        """The least the pool may shrink to: every live sequence must still fit whole (a waiting or
        running sequence that no longer fits could never be scheduled again) and the highest
        referenced block stays (O(pool): only asked when the rule wants to shrink)."""
        cm, sched = self.cache, self.scheduler
        need = cm.pool.shrink_floor()
        if sched is not None:
            for seq in (*sched.running, *sched.waiting):
                need = max(need, -(-(len(seq.prompt_token_ids) + seq.max_tokens) // cm.block_size))
        return int(need)

    def _prune_admitted(self) -> None:
        done = [sid for sid, (seq, _) in self._admitted.items() if seq.is_finished]
        for sid in done:
            del self._admitted[sid]

