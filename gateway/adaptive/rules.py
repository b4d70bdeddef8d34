"""The three rules. Each reads one window's figures and the live state and may propose one change;
it never acts (the controller applies, logs and counts). Rules are evaluated once per window, so
no rule can fire twice in a window; on top of that each has its own hysteresis so that evidence
near a threshold does not make it flap:

* eviction policy: switch only to a ghost that beats the active policy's ghost by a margin and
  significantly (paired test over the same requests): at once when the live hit rate is falling
  while evictions rise and this window's ghosts agree (z >= alarm_z(alternatives), the best of
  several tested on one window), otherwise only after the
  same ghost has led with z >= SIGNIFICANCE_Z over the recent horizon for PATIENCE_WINDOWS windows
  (a fall without a clear winner restarts that horizon: older evidence is another phase). No alarm
  in the PATIENCE_WINDOWS windows after a switch: the switch itself moves the live hit rate;
* max_num_seqs: lower at once on preemptions (multiplicative), raise slowly (additive) only after
  PATIENCE_WINDOWS quiet windows and only while requests are queueing (else raising buys nothing);
* KV bit width: widen a layer at once when its error exceeds the bound, narrow it again only after
  the narrower width's error has stayed under RECOVER_RATIO x bound for PATIENCE_WINDOWS windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nanokv.config import KV_WIDTHS
from nanokv.gateway.adaptive.settings import (
    LOWER_FACTOR,
    PATIENCE_WINDOWS,
    RAISE_FACTOR,
    RECOVER_RATIO,
    SIGNIFICANCE_Z,
    AdaptiveSettings,
    alarm_z,
)
from nanokv.gateway.adaptive.window import WindowStats
from nanokv.messages import GhostScores

LADDER = KV_WIDTHS  # KV bit widths, narrowest first; 16 = the model dtype, no compression error


@dataclass(frozen=True)
class Proposal:
    kind: str  # "eviction_policy" | "max_num_seqs" | "kv_bits"
    action: str  # what changes, in words ("clock -> lru_k")
    target: Any  # policy name | new max_num_seqs | {layer: bits}
    reason: str


class PolicyRule:
    kind = "eviction_policy"

    def __init__(self, s: AdaptiveSettings) -> None:
        self.margin = s.policy_switch_margin
        self.threshold = s.hit_rate_threshold
        self._prev: WindowStats | None = None
        self._lead: str | None = None
        self._lead_windows = 0
        self._since_switch = PATIENCE_WINDOWS  # windows since this rule last proposed a switch
        self.phase_change = False  # set by evaluate(): the controller restarts the ghosts' recent evidence

    def _falling(self, prev: WindowStats | None, w: WindowStats) -> bool:
        """The brief's alarm: hit rate fell below threshold x the previous window's while evictions rose."""
        if prev is None or prev.hit_rate is None or w.hit_rate is None:
            return False
        return w.hit_rate < self.threshold * prev.hit_rate and w.evictions > prev.evictions

    def evaluate(self, w: WindowStats, ghosts: tuple[GhostScores, GhostScores] | None,
                 active: str) -> Proposal | None:
        """ghosts: (this window's, recent decayed) evidence, from GhostCaches.window_scores()."""
        prev, self._prev = self._prev, w
        self._since_switch += 1
        self.phase_change = False
        if ghosts is None or active not in ghosts[0].hits or w.evictions == 0:  # no pressure: moot
            self._lead, self._lead_windows = None, 0
            return None
        # Right after a switch the live hit rate moves because of the switch itself (the new policy
        # starts from the old one's state): no alarm then, only the steady path.
        falling = self._since_switch > PATIENCE_WINDOWS and self._falling(prev, w)
        self.phase_change = falling
        # an alarm is judged on this window alone (the past is another phase), a steady lead on the
        # recent horizon (one window of a steady workload is too noisy)
        ev = ghosts[0] if falling else ghosts[1]
        ratios = ev.ratios
        best = max(ratios, key=lambda p: (ratios[p], p == active))  # a tie keeps the active policy
        regret = ratios[best] - ratios[active]
        z = ev.z(best, active)
        if best == active or regret < self.margin or z < (alarm_z(len(ratios) - 1) if falling else SIGNIFICANCE_Z):
            self._lead, self._lead_windows = None, 0
            return None
        self._lead_windows = self._lead_windows + 1 if best == self._lead else 1
        self._lead = best
        if not falling and self._lead_windows < PATIENCE_WINDOWS:
            return None
        if falling:
            assert prev is not None and prev.hit_rate is not None and w.hit_rate is not None
            why = (f"hit rate falling {prev.hit_rate:.3f} -> {w.hit_rate:.3f} while evictions rise "
                   f"{prev.evictions} -> {w.evictions}; in this window")
        else:
            why = f"over the recent windows ({self._lead_windows} in a row)"
        ranked = ", ".join(f"{p} {r:.3f}" for p, r in sorted(ratios.items(), key=lambda kv: -kv[1]))
        self._lead, self._lead_windows = None, 0
        self._since_switch = 0
        return Proposal(self.kind, f"{active} -> {best}", best,
                        f"{why} {best} leads {active} by {regret:.3f} (z = {z:.1f}); ghost hit ratios: {ranked}")


class ConcurrencyRule:
    kind = "max_num_seqs"

    def __init__(self, s: AdaptiveSettings) -> None:
        self.threshold = s.preemption_threshold
        self.ceiling = s.max_num_seqs
        self._quiet = 0  # consecutive windows without preemptions

    def evaluate(self, w: WindowStats, current: int) -> Proposal | None:
        if w.preemptions >= self.threshold:
            self._quiet = 0
            # below the batch that overran memory, not below the (maybe huge) configured ceiling
            target = max(1, min(current - 1, int(w.peak_running * LOWER_FACTOR)))
            if target >= current:
                return None
            return Proposal(self.kind, f"{current} -> {target}", target,
                            f"{w.preemptions} preemptions in the window (threshold {self.threshold}), "
                            f"recompute overhead {w.recompute_overhead:.1%}, peak batch {w.peak_running}")
        self._quiet = self._quiet + 1 if w.preemptions == 0 else 0
        if current >= self.ceiling or self._quiet < PATIENCE_WINDOWS or w.mean_waiting <= 0:
            return None
        self._quiet = 0
        target = min(self.ceiling, current + max(1, int(current * RAISE_FACTOR)))
        return Proposal(self.kind, f"{current} -> {target}", target,
                        f"no preemptions for {PATIENCE_WINDOWS} windows and {w.mean_waiting:.1f} requests "
                        f"waiting on average")


class PrecisionRule:
    kind = "kv_bits"

    def __init__(self, s: AdaptiveSettings) -> None:
        self.bound = s.compression_error_bound
        self._low: dict[int, int] = {}  # layer -> consecutive windows the narrower width measured low

    def _widen(self, errs: dict[int, float], bits: int) -> int:
        """The narrowest wider width measured within the bound (16 has no compression error)."""
        return next((w for w in LADDER if bits < w < 16 and errs.get(w, float("inf")) <= self.bound), 16)

    def evaluate(self, errors: dict[int, dict[int, float]], current: Sequence[int],
                 base: Sequence[int]) -> Proposal | None:
        """errors: {layer: {bits: windowed error}} for the layers sampled in the window."""
        changes: dict[int, int] = {}
        why: list[str] = []
        for layer, errs in sorted(errors.items()):
            bits = current[layer]
            err = errs.get(bits)
            if bits < 16 and err is not None and err > self.bound:
                changes[layer] = self._widen(errs, bits)
                why.append(f"layer {layer}: error {err:.3g} at {bits} bits > bound {self.bound:g}")
                self._low[layer] = 0
                continue
            narrower = [w for w in LADDER if base[layer] <= w < bits]
            low = narrower and errs.get(narrower[-1], float("inf")) < RECOVER_RATIO * self.bound
            self._low[layer] = self._low.get(layer, 0) + 1 if low else 0
            if low and self._low[layer] >= PATIENCE_WINDOWS:
                target = narrower[-1]
                changes[layer] = target
                why.append(f"layer {layer}: error at {target} bits {errs[target]:.3g} < "
                           f"{RECOVER_RATIO:g} x bound for {self._low[layer]} windows")
                self._low[layer] = 0
        if not changes:
            return None
        action = ", ".join(f"layer {i}: {current[i]} -> {b} bits" for i, b in changes.items())
        return Proposal(self.kind, action, changes, "; ".join(why))
