"""The adaptive controller of a gateway whose cache and compute services run in other processes.

The controller (nanokv.gateway.adaptive.controller) and its rules are the very objects an
in-process engine runs; only what they read and what they change goes over the services' RPCs:

  reads                                      from
  cache counters (hits, evictions, ...)      Cache.Stats, once a window
  blocks referenced, every step              PlanReply.used_blocks (no extra call)
  ghost-cache evidence                       Cache.GhostWindow, once a window: the cache service keeps
                                             the ghosts and feeds them from its own admissions
  KV-width errors per layer                  Compute.ProbeErrors, once a window
  free device memory, bytes per block        Compute.Stats, when the pool rule would grow

  changes                                    through
  eviction policy                            Cache.SetPolicy (warm from the cache service's ghost)
  max_num_seqs                               the gateway's own scheduler
  KV widths, pool size                       Engine.repool: the attach protocol (nanokv.gateway.repool)

A pool change through the attach protocol moves no KV data: the prefix cache starts empty and the
live sequences are recomputed on the new pool (in process the actuators re-format or resize the
tensors in place and keep cached blocks). The compute service refuses a pool the device cannot
hold before it drops the old one (Compute.Repool); a refusal is the decision's note. No torch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, TypedDict

from nanokv.config import KV_WIDTHS
from nanokv.errors import NanoKVError
from nanokv.messages import CacheServiceStats, GhostScores
from nanokv.service_api import CacheAPI

if TYPE_CHECKING:
    from nanokv.gateway.engine import Engine

log = logging.getLogger("nanokv.gateway.adaptive")


class _CacheCounters:
    """What Counters.read takes from a CacheStats, from the cache service's Stats reply."""

    def __init__(self, s: CacheServiceStats):
        self.prefix_queries_tokens = int(s["prefix_queries_tokens"])
        self.prefix_hits_tokens = int(s["prefix_hits_tokens"])
        self.evictions = int(sum(s["evictions_by_policy"].values()))
        self.recomputed_tokens = int(s["recomputed_tokens"])
        self.preemptions = int(s["cache_preemptions"])


class _RepooledPool:
    @staticmethod
    def shrink_floor() -> int:
        """A repool drops every block: only the live sequences (the controller counts them) bound a shrink."""
        return 1


class RemoteCache:
    """The cache manager as the controller sees it, over the cache service's RPCs."""

    def __init__(self, engine: Engine):
        cfg = engine.config
        self.engine = engine
        self.client = engine.cache  # (a nanokv.gateway.clients.CacheClient)
        self.enable_prefix_caching = cfg.enable_prefix_caching
        self.block_size = engine.model_info.block_size
        self.lru_k = cfg.lru_k
        self.policy_name: str = self.client.stats()["eviction_policy"]
        self.pool = _RepooledPool()

    @property
    def num_blocks(self) -> int:
        return int(self.engine.num_blocks)

    @property
    def stats(self) -> _CacheCounters:
        return _CacheCounters(self.client.stats())

    def num_used_blocks(self) -> int:
        return int(self.engine.scheduler.used_blocks)

    def set_policy(self, name: str, donor: object = None) -> None:
        self.client.set_policy(name)  # (the donor is the cache service's own ghost of `name`)
        self.policy_name = name


class RemoteGhosts:
    """The cache service's ghost caches (nanokv.cache_service.ghosts), read once a window."""

    def __init__(self, client: CacheAPI):
        self.client = client
        self.caches: dict[str, object] = {}  # no local donor: SetPolicy takes the cache service's ghost

    def window_scores(self) -> tuple[GhostScores, GhostScores] | None:
        return self.client.ghost_window()

    def restart_recent(self) -> None:
        self.client.restart_ghosts()

    def resize(self, capacity: int) -> None:
        """Nothing to do: the cache service resizes its ghosts with the pool it allocates."""


def _repool(engine: Engine, num_blocks: int | None = None, layer_bits: list[int] | None = None) -> str:
    """Engine.repool; '' on success, else why not (a refused layout changes nothing). With async
    scheduling the step in flight lands first: its outputs go out with the engine's next step."""
    try:
        engine.stashed.extend(engine.repool(num_blocks, layer_bits))
    except NanoKVError as e:
        return str(e)
    return ""


class RemotePrecision:
    """The KV-width rule's actuator (PrecisionControl): widths change through a repool."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.base_bits: list[int] = list(engine.model_info.layer_bits)

    def current_bits(self) -> list[int]:
        return list(self.engine.model_info.layer_bits)

    def window_errors(self) -> dict[int, dict[int, float]]:
        return dict(self.engine.compute.probe_errors())

    def apply(self, changes: dict[int, int]) -> dict[int, str]:
        bits = self.current_bits()
        refused: dict[int, str] = {}
        for layer, b in changes.items():
            if b < self.base_bits[layer] or b not in KV_WIDTHS:
                refused[layer] = f"{b} bits is not allowed (planned {self.base_bits[layer]})"
            else:
                bits[layer] = b
        if bits == self.current_bits():
            return refused
        why = _repool(self.engine, layer_bits=bits)
        if why:
            return {layer: why for layer in changes}
        log.info("adaptive kv_bits: pool re-attached with widths %s", bits)
        return refused


class RemotePool:
    """The pool rule's actuator (PoolControl): the pool grows and shrinks through a repool."""

    def __init__(self, engine: Engine, reserve_bytes: int | None, margin_bytes: int):
        self.engine = engine
        self.base_blocks: int = int(engine.num_blocks)
        self.reserve_bytes = reserve_bytes
        self.margin_bytes = margin_bytes

    def headroom_blocks(self) -> int:
        """How far the pool may grow: the reserve beyond the start-up size, and on CUDA the device's
        free memory less the margin (a larger pool is allocated whole: Compute.Repool)."""
        s = self.engine.compute.stats()
        per_block = int(s["kv_bytes_per_block"])
        if per_block <= 0:
            return 0
        grown = self.engine.num_blocks - self.base_blocks
        room = None if self.reserve_bytes is None else self.reserve_bytes // per_block - grown
        if self.engine.device_type == "cuda":
            fits = (int(s["device_free_bytes"]) - self.margin_bytes) // per_block
            room = fits if room is None else min(room, fits)
        return max(0, int(room or 0))

    def resize(self, num_blocks: int) -> tuple[int, str]:
        before = int(self.engine.num_blocks)
        if num_blocks > before and num_blocks - before > self.headroom_blocks():
            return before, f"needs {num_blocks - before} more blocks, memory allows {self.headroom_blocks()}"
        why = _repool(self.engine, num_blocks=num_blocks)
        log.info("KV pool %d -> %d blocks through a repool (start-up size %d)", before, self.engine.num_blocks,
                 self.base_blocks)
        return int(self.engine.num_blocks), why


class RemoteParts(TypedDict):
    """AdaptiveController's keyword arguments for a gateway with remote services."""
    cache: RemoteCache
    ghosts: RemoteGhosts | None
    policy_rule: bool
    precision: RemotePrecision | None
    pool: RemotePool | None


def remote_parts(engine: Engine, full: bool) -> RemoteParts:
    """The controller's keyword arguments for a gateway with remote services."""
    cfg = engine.config
    cache = RemoteCache(engine)
    parts = RemoteParts(cache=cache, ghosts=RemoteGhosts(engine.cache), policy_rule=True, precision=None, pool=None)
    if not cfg.enable_prefix_caching:
        parts["ghosts"], parts["policy_rule"] = None, False
    else:
        try:
            engine.cache.ghost_window()  # (an empty window: nothing was admitted yet)
        except NanoKVError as e:  # a cache service started without the controller in its config
            log.warning("adaptive: eviction-policy rule off: the cache service keeps no ghost caches (%s)", e)
            parts["ghosts"], parts["policy_rule"] = None, False
    if not full:
        return parts
    if cfg.compression_sparsity:  # (the cache service's setting, taken at attach)
        # both act through a repool, which block sparsity refuses: its decisions and the INT4 demotion
        # store are sized on the start-up pool (in one process the pool rule resizes in place instead)
        log.warning("adaptive: KV-width and pool rules off with block sparsity over the services' RPCs")
        return parts
    if any(b < 16 for b in engine.model_info.layer_bits):
        parts["precision"] = RemotePrecision(engine)  # (tensor parallel too: Compute.Repool widens every rank)
    if engine.device_type == "cuda" or cfg.adaptive_pool_reserve_bytes is not None:
        parts["pool"] = RemotePool(engine, cfg.adaptive_pool_reserve_bytes, cfg.adaptive_pool_margin_bytes)
    else:
        log.info("adaptive: KV pool rule off on %s without adaptive_pool_reserve_bytes (nothing to grow into)",
                 engine.device_type)
    return parts
