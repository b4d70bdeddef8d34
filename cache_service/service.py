"""CacheService: block allocation, prefix hashing, eviction and the KV storage, behind one API.

The same object serves the in-process transport (LLM(): the gateway calls it directly) and the
gRPC server (nanokv.cache_service.server), so both run this code. Lifecycle:

  attach(layout)  the compute service (once per incarnation) asks for the pool: the storage is
                  allocated, a cache manager of layout.num_blocks blocks is made, and a handle
                  comes back (epoch + 1 on every attach; a new attach drops the old pool)
  plan(request)   every step: one transaction on the blocks (nanokv.cache_service.planner)
  free_storage    in process only: the runner moved every layer out of the segment (in place)
  stats()         counters for /metrics

With ``ghosts`` (the gRPC server, when the adaptive controller's policy rule is on) it also keeps
the controller's ghost caches, fed from its own admissions: a gateway whose services run apart
reads their evidence once a window (ghost_window) and switches the live policy warm (set_policy).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

from nanokv.cache_service.kv_events import KVEventLog
from nanokv.cache_service.manager import CacheStats, KVCacheManager
from nanokv.cache_service.plan_trace import plan_span
from nanokv.cache_service.planner import Planner
from nanokv.cache_service.tiers.stats import add_tier_stats
from nanokv.cache_service.validate import validate_plan
from nanokv.config import ADAPTIVE_START_POLICY, CacheConfig
from nanokv.errors import PreconditionError, StaleEpoch
from nanokv.lease import Leases
from nanokv.messages import CacheServiceStats, GhostScores, PlanReply, PlanRequest, PoolHandle, PoolLayout
from nanokv.service_api import PendingPlan

if TYPE_CHECKING:
    from nanokv.cache_service.ghosts import GhostCaches
    from nanokv.cache_service.storage import PoolStorage
    from nanokv.cache_service.tiers.disk_store import DiskStore
    from nanokv.cache_service.tiers.serving import ServingTiers

log = logging.getLogger("nanokv.cache_service")


class PlanDone:
    """CacheAPI.plan_async in process: the plan was made at once; wait() hands its reply over."""
    __slots__ = ("reply",)

    def __init__(self, reply: PlanReply):
        self.reply = reply

    def wait(self) -> PlanReply:
        return self.reply


class NotAttached(PreconditionError):
    def __init__(self) -> None:
        super().__init__("cache", "no compute service has attached a KV pool yet")


class CacheService:
    """nanokv.service_api.CacheAPI in process (and behind the gRPC server), plus the pool's attach."""

    plan_rtt_s = 0.0  # CacheAPI: a plan here is answered within plan_async, no round trip

    def __init__(self, config: CacheConfig, *, shared: bool = False, ghosts: bool = False):
        """shared: allocate the pool in shared memory (a compute service in another process maps it).
        ghosts: keep the adaptive controller's ghost caches here (when its policy rule is on)."""
        self.config = config
        self.attached_model = ""  # the attached compute service's model (PoolTerms.model), as it told
        self.shared = shared
        self.ghosts: GhostCaches | None = None  # made at the first attach
        self.live_policy: str | None = None  # set_policy's choice: a later pool (repool) keeps it
        self._stats: CacheStats | None = None  # the last pool's counters, while none is attached
        self._want_ghosts = ghosts and config.enable_prefix_caching and (
            config.adaptive or config.eviction_policy == "adaptive")
        self.manager: KVCacheManager | None = None
        self.planner: Planner | None = None
        self.storage: PoolStorage | None = None  # (its module imports torch: loaded on attach)
        self.host_storage: PoolStorage | None = None  # the host tier's segment (cpu_offload_bytes)
        self.tiers: ServingTiers | None = None
        self.disk_store: DiskStore | None = None  # the disk tier's files (disk_cache_dir), kept across pools
        self.disk_store_fp = ""
        # epochs start at this incarnation's start time (ms): a restarted cache service never hands
        # out an epoch a compute service or gateway still holds from the one before
        self.epoch = int(time.time() * 1000)
        self.attached_epoch = 0  # the epoch a compute service holds a mapping of (0: none)
        self.leases = Leases(config.gateway_lease_s)
        self.lock = threading.Lock()  # gRPC handlers run on a thread pool; a plan is one transaction
        self.plan_calls = 0
        # block events for a KV-aware router (cache_service/kv_events.py); one log per incarnation
        self.events = KVEventLog(block_size=0, hash_algo=config.prefix_caching_hash_algo)

    # ---- the pool ---------------------------------------------------------------------------------
    def attach(self, layout: PoolLayout) -> PoolHandle:
        from nanokv.cache_service.storage import PoolStorage

        cfg = self.config
        with self.lock:
            self.epoch += 1
            carried = self.manager.stats if self.manager is not None else self._stats
            if self.storage is not None and self.storage.reusable_for(layout):
                self.storage.epoch = self.epoch  # same device segment, a new incarnation of its contents
                storage = self.storage
            else:
                self._drop_pool()
                storage = self.storage = PoolStorage(layout, self.shared, self.epoch)
            self.attached_epoch = self.epoch
            self.manager = KVCacheManager(
                layout.num_blocks, layout.block_size, enable_prefix_caching=cfg.enable_prefix_caching,
                # "adaptive": start from leaf_lru; the controller switches when it pays
                eviction_policy=self.live_policy or (ADAPTIVE_START_POLICY if cfg.eviction_policy == "adaptive"
                                                     else cfg.eviction_policy),
                lru_k=cfg.lru_k, hash_algo=cfg.prefix_caching_hash_algo,
            )
            self.events.block_size = layout.block_size
            self.events.cleared()  # a new manager starts empty
            self.manager.set_event_log(self.events)
            if carried is not None:  # counters stay monotonic across pools of one incarnation (/metrics)
                carried.evictions_by_policy.setdefault(self.manager.policy_name, 0)
                self.manager.stats = carried
            self._attach_ghosts(layout)
            self._close_tier_writers()  # the new pool's tiers get their own
            self.tiers = None
            handle = storage.handle()
            if cfg.cpu_offload_bytes:
                handle = self._attach_host_tier(layout, handle)
            self.planner = Planner(self.manager, self.ghosts.observe if self.ghosts is not None else None,
                                   tiers=self.tiers)
            self._attach_sparsity()
            return handle

    def _attach_host_tier(self, layout: PoolLayout, handle: PoolHandle) -> PoolHandle:
        """L2: a host segment of as many blocks of the pool's layout as cpu_offload_bytes holds, made
        anew with each pool (its slots are addressed by the new pool's copies)."""
        from nanokv.cache_service.storage import PoolStorage, host_layout
        from nanokv.cache_service.tiers.formats import TierFormat
        from nanokv.cache_service.tiers.serving import ServingTiers

        cfg = self.config
        if layout.rank_devices:
            raise PreconditionError("cpu_offload_bytes", "the host tier does not support tensor parallelism yet")
        if 4 in layout.layer_bits:  # an int4 layer keeps recent blocks in its staging, outside the codes
            raise PreconditionError("cpu_offload_bytes", "the host tier holds 16- and 8-bit layers only, "
                                                         "not int4 (quantization_bitwidth 4)")
        l2, per_block = host_layout(layout, cfg.cpu_offload_bytes, cfg.cpu_offload_kv_format)
        slots = l2.num_blocks
        # disk hits are read into staging slots past L2's: one batch of prefill blocks per plan
        staging = min(256, max(8, slots // 4)) if cfg.disk_cache_dir or cfg.remote_cache_url else 0
        # and the spare slots L2 blocks take while their victim's slot is written to disk (serving.py)
        spare = staging if cfg.disk_cache_dir else 0
        if self.host_storage is not None:
            self.host_storage.close()
        self.host_storage = PoolStorage(dataclasses.replace(l2, num_blocks=slots + staging + spare), self.shared,
                                        self.epoch)
        assert self.manager is not None  # made by attach, under the lock
        bits = max(l2.layer_bits)
        fmt = TierFormat(cfg.cpu_offload_kv_format, bits, per_block)
        disk = host = remote = None
        if staging:
            from nanokv.cache_service.storage import HostSlots

            host = HostSlots(self.host_storage)
        if cfg.disk_cache_dir and host is not None:
            from nanokv.cache_service.tiers.disk_tier import DiskTier

            disk = DiskTier(self._disk_store(l2), host.slot_bytes, bits, cfg.disk_cache_policy)
        if cfg.remote_cache_url and host is not None:
            from nanokv.cache_service.tiers.remote_store import RemoteStore, check_url
            from nanokv.cache_service.tiers.remote_tier import RemoteTier

            check_url(cfg.remote_cache_url)
            store = RemoteStore(cfg.remote_cache_url, self._fingerprint(l2), ttl_s=cfg.remote_cache_ttl_s)
            remote = RemoteTier(store, host.slot_bytes)
        self.tiers = ServingTiers(self.manager, slots, fmt, cfg.cpu_offload_policy, disk=disk, host=host,
                                  staging=staging, remote=remote, spare=spare)
        log.info("host tier (L2): %d blocks, %d bytes, format %s, policy %s", slots, self.host_storage.nbytes,
                 cfg.cpu_offload_kv_format, cfg.cpu_offload_policy)
        return dataclasses.replace(handle, host_tier=self.host_storage.handle(),
                                   host_tier_blocks=slots + staging + spare)

    def _fingerprint(self, layout: PoolLayout) -> str:
        """What a stored block's bytes depend on: the model and the host tier's KV layout (disk files,
        shared tier): its layer bits are the tier format's (cpu_offload_kv_format), so a change of
        either format makes every stored block foreign."""
        return (f"model={self.attached_model or 'unnamed'};bits={layout.layer_bits};dtype={layout.dtype};"
                f"block={layout.block_size};heads={layout.num_kv_heads};dim={layout.head_dim}")

    def _disk_store(self, layout: PoolLayout) -> DiskStore:
        """The disk tier's store, opened once per process (it locks its directory) for the model and KV
        layout its files must match: a file of another model or format is dropped at start-up."""
        from nanokv.cache_service.tiers.disk_store import DiskStore

        cfg = self.config
        fp = self._fingerprint(layout)
        if self.disk_store is not None and self.disk_store_fp != fp:
            self.disk_store.close()
            self.disk_store = None
        if self.disk_store is None:
            assert cfg.disk_cache_dir is not None  # (the caller checked)
            self.disk_store = DiskStore(cfg.disk_cache_dir, cfg.disk_cache_bytes, fp)
            self.disk_store_fp = fp
            r = self.disk_store.reindex_report
            log.info("disk tier (L3) at %s: %s", cfg.disk_cache_dir, r)
        return self.disk_store

    def _attach_sparsity(self) -> None:
        """Block sparsity on the new pool (nanokv.cache_service.sparsity): its decisions, and the INT4
        demotion store's free list, sized by the pool as the compute service sizes the store."""
        params = self.config.sparsity_params
        if params is None or self.planner is None or self.manager is None:
            return
        from nanokv.cache_service.sparsity.decide import CacheSparsity

        self.planner.sparsity = CacheSparsity(params, self.manager)

    def _attach_ghosts(self, layout: PoolLayout) -> None:
        """The ghosts model the live pool: made once, then resized with it (a repool keeps their
        history, as the in-process controller's ghosts keep theirs across a pool resize)."""
        if not self._want_ghosts:
            return
        from nanokv.cache_service.ghosts import GhostCaches

        if self.ghosts is None:
            cfg = self.config
            assert self.manager is not None  # made just before
            self.ghosts = GhostCaches((*cfg.policy_candidates, self.manager.policy_name), layout.num_blocks,
                                      layout.block_size, lru_k=cfg.lru_k)
        elif self.ghosts.capacity != layout.num_blocks:
            self.ghosts.resize(layout.num_blocks)

    def detach(self, epoch: int) -> None:
        """The compute service dropped its mapping of `epoch`'s pool (its shutdown). Plans fail until
        the next attach; the storage stays for a restarted compute service of the same layout."""
        with self.lock:
            if epoch == self.attached_epoch:
                self.attached_epoch = 0
                self._stats = self.manager.stats if self.manager is not None else self._stats
                self.manager = self.planner = None
                self.events.cleared()

    def free_storage(self, epoch: int) -> None:
        """The compute service in this process views no byte of `epoch`'s segment any more: an
        in-place resize or re-format (the adaptive controller's pool and width rules) moved every layer
        into tensors of its own. The segment goes, so its memory does; the manager, its blocks and the
        epoch stay (their contents live on in those tensors). The next attach allocates anew."""
        with self.lock:
            if self.storage is not None and epoch == self.attached_epoch:
                self.storage.close()
                self.storage = None

    def _drop_pool(self) -> None:
        if self.storage is not None:
            self.storage.close()
        if self.host_storage is not None:
            self.host_storage.close()
        self.storage = self.host_storage = self.manager = self.planner = self.tiers = None

    def _close_tier_writers(self) -> None:
        if self.tiers is not None:
            if self.tiers.disk is not None:
                self.tiers.disk.close()
            if self.tiers.remote is not None:
                self.tiers.remote.close()

    def close_disk(self) -> None:
        """Let the disk tier's directory go (its lock): the engine in this process shuts down."""
        with self.lock:
            self._close_tier_writers()  # their queued writes land first
            if self.disk_store is not None:
                self.disk_store.close()
                self.disk_store = None
            if self.tiers is not None and (self.tiers.disk is not None or self.tiers.remote is not None):
                self.tiers = None
                if self.planner is not None:
                    self.planner.tiers = None

    def close(self) -> None:
        with self.lock:
            self._close_tier_writers()
            self._drop_pool()
            if self.disk_store is not None:
                self.disk_store.close()
                self.disk_store = None

    @property
    def attached(self) -> bool:
        return self.manager is not None

    # ---- the step ---------------------------------------------------------------------------------
    def info(self) -> tuple[CacheConfig, str]:
        """Its config, and the model of the compute service attached ("": none attached)."""
        return self.config, self.attached_model if self.attached_epoch else ""

    def plan(self, request: PlanRequest) -> PlanReply:
        with self.lock:
            if self.planner is None:
                raise NotAttached()
            if request.epoch and request.epoch != self.attached_epoch:
                raise StaleEpoch(request.epoch, self.attached_epoch)
            validate_plan(self.planner, request)  # whole, before any change: a plan is one transaction
            self.leases.renew(request.gateway_id)
            self.plan_calls += 1
            with plan_span(self, request) as traced:
                reply = self.planner.plan(request)
                if traced is not None:
                    traced.reply = reply
            return reply

    def plan_async(self, request: PlanRequest) -> PendingPlan:
        """CacheAPI.plan_async: in process the plan is made now (a gRPC client's reply comes later)."""
        return PlanDone(self.plan(request))

    # ---- administration -----------------------------------------------------------------------
    def reset_prefix_cache(self, clear_stats: bool = False) -> None:
        """Every cached block that no sequence holds is dropped (clear_stats: the counters too)."""
        with self.lock:
            if self.manager is None:
                raise NotAttached()
            self.manager.reset_prefix_cache()
            if self.tiers is not None:
                self.tiers.clear()
            if clear_stats:
                self.manager.stats.clear()

    # ---- the adaptive controller's policy rule (a gateway in another process) ----------------------
    def ghost_window(self) -> tuple[GhostScores, GhostScores] | None:
        """GhostCaches.window_scores(): (this window's, recent) evidence, or None."""
        with self.lock:
            return self._ghosts().window_scores()

    def restart_ghosts(self) -> None:
        with self.lock:
            self._ghosts().restart_recent()

    def set_policy(self, name: str) -> None:
        """Switch the live eviction policy, warm from its ghost (every cached block stays)."""
        with self.lock:
            if self.manager is None:
                raise NotAttached()
            ghosts = self._ghosts()
            if name not in ghosts.caches:
                raise PreconditionError("policy", f"{name!r} has no ghost here; allowed: {', '.join(ghosts.caches)}")
            self.manager.set_policy(name, donor=ghosts.caches[name])
            self.live_policy = name

    def _ghosts(self) -> GhostCaches:
        if self.ghosts is None:
            raise PreconditionError("ghosts", "the cache service keeps no ghost caches (the adaptive policy rule is "
                                              "off in its config, or prefix caching is off, or no pool is attached)")
        return self.ghosts

    def release(self, gateway_id: str | None = None) -> None:
        """A gateway went away (its lease ran out) or starts over: every sequence it held ends and
        its blocks go back (None: every gateway's)."""
        with self.lock:
            self.leases.drop(gateway_id)
            n = self.planner.forget_all(gateway_id) if self.planner is not None else 0
        log.info("released %d sequences of gateway %s", n, gateway_id or "(all)")

    def stats(self) -> CacheServiceStats:
        with self.lock:
            cm = self.manager
            if cm is None:
                raise NotAttached()
            cs = cm.stats
            sp = self.planner.sparsity if self.planner is not None else None
            out: CacheServiceStats = {
                "kv_cache_usage": cm.usage(),
                "kv_blocks_total": cm.num_blocks,
                "kv_blocks_free": cm.num_free_blocks(),
                "kv_blocks_cached": cm.num_cached_blocks(),
                "prefix_queries_tokens": cs.prefix_queries_tokens,
                "prefix_hits_tokens": cs.prefix_hits_tokens,
                "evictions_by_policy": dict(cs.evictions_by_policy),
                "eviction_policy": cm.policy_name,
                "recomputed_tokens": cs.recomputed_tokens,
                "cache_preemptions": cs.preemptions,
                "num_seqs": self.planner.num_seqs if self.planner is not None else 0,
                "epoch": self.epoch,
                "attached_epoch": self.attached_epoch,
                "plan_calls": self.plan_calls,
                # block sparsity (nanokv.cache_service.sparsity.decide), 0 when off
                "sparsity_blocks_dropped": sp.blocks_dropped if sp is not None else 0,
                "sparsity_blocks_demoted": sp.blocks_demoted if sp is not None else 0,
            }
            if self.tiers is not None:
                add_tier_stats(out, self.tiers)
            return out
