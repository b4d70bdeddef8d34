"""Where a workload's hits above LRU are, and which of them an online policy can reach.

    python -m nanokv.sim.headroom [--workloads conversation,long_conversation] [--seeds 0,1,2,3,4]
                                  [--capacity 5%] [--json OUT]

Besides LRU, leaf_lru and Belady it replays two oracles and two probes (simulator-only policies, not
in the registry; docs/cache-policies.md, "The headroom"):

* ``dead_leaf_oracle`` - LRU plus a cold FIFO, evicted first, for every sequence's *last* block that
  is never requested again: what leaf_lru learns, known exactly.
* ``ended_oracle`` - the same for *every* block never requested again: the conversations that
  ended, which nothing in the request stream announces.
* ``probe_reused`` - leaf_lru whose reused blocks age ``w`` times slower (frequency and turn-count
  protection: a conversation that came back before is kept longer).
* ``probe_idle_gap`` - leaf_lru plus end prediction from a block's own inter-reference gap: a block
  idle for more than ``k`` times its last gap is taken to have ended and goes first (LIRS-like).
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

from nanokv.cache_service.policies.base import EvictionPolicy
from nanokv.cache_service.policies.leaf_lru import LeafLRUPolicy
from nanokv.sim.replay import keys_of, replay
from nanokv.sim.simulate import parse_capacities
from nanokv.sim.traces import SYNTHETIC

NextUse = Callable[[Hashable], float]  # index of the next request using a key, inf if none


class DeadOracle(EvictionPolicy):
    """LRU; a block the oracle says is never requested again goes to a cold FIFO evicted first
    (``leaves_only``: only a sequence's last block, ``tail == 0``)."""

    name = "dead_oracle"

    def __init__(self, capacity: int, next_use: NextUse, leaves_only: bool) -> None:
        super().__init__(capacity)
        self._next_use, self.leaves_only = next_use, leaves_only
        self._cold: OrderedDict[int, None] = OrderedDict()
        self._lru: OrderedDict[int, None] = OrderedDict()

    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        if self._next_use(key) == float("inf") and (tail == 0 or not self.leaves_only):
            self._cold[block_id] = None
        else:
            self._lru[block_id] = None
            self._lru.move_to_end(block_id)

    def on_hit(self, block_id: int) -> None:
        if block_id in self._lru:
            self._lru.move_to_end(block_id)

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        self._cold.pop(block_id, None)
        self._lru.pop(block_id, None)

    def victim(self) -> int:
        return (self._cold if self._cold else self._lru).popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._cold) + len(self._lru)

    def snapshot(self) -> list[tuple[int, bool]]:
        return [(b, False) for q in (self._cold, self._lru) for b in q]


class ReusedAgesSlower(LeafLRUPolicy):
    """leaf_lru with its reused blocks in a second LRU list: the victim is the head of the list whose
    head is older, the reused list's age counted ``1 / w`` (O(1): two heads compared)."""

    name = "probe_reused"

    def __init__(self, capacity: int, w: float = 2.0) -> None:
        super().__init__(capacity)
        self.w = w
        self._hot: OrderedDict[int, int] = OrderedDict()  # block -> release time, oldest first
        self._released: dict[int, int] = {}  # evictable block -> its release time

    def _promote(self, block_id: int) -> None:
        if block_id in self._reused and block_id in self._lru:
            del self._lru[block_id]
            self._hot[block_id] = self._released[block_id]
        if block_id in self._hot:
            self._hot.move_to_end(block_id)

    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        super().on_evictable(block_id, key, depth, tail)
        self._released[block_id] = self._now
        self._promote(block_id)

    def on_hit(self, block_id: int) -> None:
        super().on_hit(block_id)
        if block_id in self._released:
            self._promote(block_id)

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        super().on_remove(block_id, forget)
        self._hot.pop(block_id, None)
        self._released.pop(block_id, None)

    def victim(self) -> int:
        if not self._cold and self._hot:
            hot_age = self._now - next(iter(self._hot.values()))
            if not self._lru or (self._now - self._released[next(iter(self._lru))]) * self.w < hot_age:
                block_id, _ = self._hot.popitem(last=False)
                del self._key[block_id]
                self._reused.discard(block_id)
                self._released.pop(block_id, None)
                return block_id
        block_id = super().victim()
        self._released.pop(block_id, None)
        return block_id

    def __len__(self) -> int:
        return super().__len__() + len(self._hot)

    def snapshot(self) -> list[tuple[int, bool]]:
        return super().snapshot() + [(b, True) for b in self._hot]


class IdleGapEnd(LeafLRUPolicy):
    """leaf_lru; a block released again after a hit is predicted to have ended once it is idle for
    ``k`` times the gap between its last two releases, and goes before the LRU list (a lazy heap of
    predicted end times, O(log n))."""

    name = "probe_idle_gap"

    def __init__(self, capacity: int, k: float = 8.0) -> None:
        super().__init__(capacity)
        self.k = k
        self._released: dict[int, int] = {}  # block -> last release time, while it has a key
        self._ends: list[tuple[float, int, int]] = []  # (predicted end, block, version)
        self._version: dict[int, int] = {}

    def _bump(self, block_id: int) -> None:
        self._version[block_id] = self._version.get(block_id, 0) + 1

    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        before = self._released.get(block_id)
        super().on_evictable(block_id, key, depth, tail)
        self._released[block_id] = self._now
        if before is not None and block_id in self._lru:
            self._bump(block_id)
            heapq.heappush(self._ends, (self._now + self.k * (self._now - before), block_id,
                                        self._version[block_id]))

    def on_remove(self, block_id: int, forget: bool = False) -> None:
        super().on_remove(block_id, forget)
        self._bump(block_id)
        if forget:
            self._released.pop(block_id, None)

    def victim(self) -> int:
        ends = self._ends
        while ends and (ends[0][2] != self._version.get(ends[0][1]) or ends[0][1] not in self._lru):
            heapq.heappop(ends)
        if not self._cold and ends and ends[0][0] < self._now:
            _, block_id, _ = heapq.heappop(ends)
            del self._lru[block_id]
            del self._key[block_id]
            self._reused.discard(block_id)
        else:
            block_id = super().victim()
        self._bump(block_id)
        self._released.pop(block_id, None)
        return block_id


class _EvictionAges(LeafLRUPolicy):
    """leaf_lru that records how long each block it evicts from the LRU list had been idle (releases)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.ages: list[int] = []
        self._released: dict[int, int] = {}

    def on_evictable(self, block_id: int, key: Hashable, depth: int, tail: int = -1) -> None:
        super().on_evictable(block_id, key, depth, tail)
        self._released[block_id] = self._now

    def victim(self) -> int:
        from_lru = not self._cold
        block_id = super().victim()
        released = self._released.pop(block_id)
        if from_lru:
            self.ages.append(self._now - released)
        return block_id


BUILDERS: dict[str, Callable[[int, NextUse], EvictionPolicy]] = {
    "dead_leaf_oracle": lambda cap, nu: DeadOracle(cap, nu, leaves_only=True),
    "probe_reused": lambda cap, _nu: ReusedAgesSlower(cap, w=2.0),
    "probe_idle_gap": lambda cap, _nu: IdleGapEnd(cap, k=8.0),
    "ended_oracle": lambda cap, nu: DeadOracle(cap, nu, leaves_only=False),
}
COLUMNS = ("leaf_lru", "dead_leaf_oracle", "probe_reused", "probe_idle_gap", "ended_oracle", "belady")


def headroom(reqs: Sequence[Any], capacity: int) -> dict[str, Any]:
    """Block hits of LRU and of every column at one capacity, plus leaf_lru's median eviction age in
    seconds (the time an idle conversation stays cached)."""
    keys = keys_of(reqs)
    hits = {p: replay(reqs, p, capacity, keys=keys).block_hits for p in ("lru", "leaf_lru", "belady")}
    for name, build in BUILDERS.items():
        hits[name] = replay(reqs, name, capacity, keys=keys, build=build).block_hits
    probe: list[_EvictionAges] = []

    def aged(cap: int, _nu: NextUse) -> EvictionPolicy:
        probe.append(_EvictionAges(cap))
        return probe[0]

    replay(reqs, "leaf_lru", capacity, keys=keys, build=aged)
    seconds_per_release = (reqs[-1].timestamp - reqs[0].timestamp) / 1000.0 / max(1, probe[0]._now)
    age = statistics.median(probe[0].ages) * seconds_per_release if probe[0].ages else 0.0
    total = sum(len(r.hash_ids) for r in reqs)
    return {"capacity": capacity, "blocks": total, "hits": hits, "eviction_age_s": age}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanokv.sim.headroom", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="conversation,long_conversation")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--capacity", default="5%", help="one capacity: a percentage of unique blocks or a count")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(list(argv) if argv is not None else None)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYNTHETIC]
    if unknown:
        print(f"error: --workloads: unknown {unknown}; allowed: {', '.join(SYNTHETIC)}", file=sys.stderr)
        return 2
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        print(f"error: --seeds {args.seeds!r}: a comma list of integers", file=sys.stderr)
        return 2
    print("| trace | LRU | " + " | ".join(COLUMNS) + " | idle conversation kept |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    out: dict[str, Any] = {}
    for name in names:
        for seed in seeds:
            reqs = SYNTHETIC[name](512, seed=seed)
            cap = parse_capacities(args.capacity, len({h for r in reqs for h in r.hash_ids}))[0]
            row = out[f"{name}@{seed}"] = headroom(reqs, cap)
            lru = row["hits"]["lru"]
            cells = " | ".join(f"{row['hits'][c] / lru:.3f}" for c in COLUMNS)
            print(f"| {name}@{seed} | {lru / row['blocks']:.3f} | {cells} | {row['eviction_age_s']:.0f} s |",
                  flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
