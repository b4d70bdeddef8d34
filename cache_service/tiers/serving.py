"""The hierarchy in the serving path: the host tier (L2) of the cache service and the copies it asks for.

The cache service decides every movement in its plan, with the same TieredCache the simulator
replays (hierarchy.py). Bytes between the device pool (L1) and the host segment (L2) are moved by
the compute service, which maps both segments: the plan's reply lists the copies
(PlanReply.copies, (kind, L1 block, L2 slot)), the gateway hands them to the next step
(StepRequest.copies), and the compute service runs them in that order before the step's forward
pass. That order is the whole synchronisation:
  * a victim's write-back (COPY_SAVE) was logged when the allocation took its block, so it runs
    before the forward pass that writes the block's new owner;
  * a hit's load (COPY_LOAD) was logged after the allocation's write-backs, so it lands in its
    fresh block before the forward pass reads it, and before a later copy reuses its L2 slot;
  * steps run in order on the compute service (on a GPU, on one stream), so the copies of a plan
    sent ahead under async scheduling still follow the step before them.
No RPC carries KV. The cache service itself touches host bytes only for the disk tier (L3): it
writes an L2 victim's slot to a file, and reads a file into a staging slot (host slots past L2's)
that a COPY_LOAD then takes to the device. Those must not race the copies of steps still in flight
(async scheduling runs up to two): every plan gets a number, each slot remembers the last plan whose
copies touched it, and the gateway reports the last plan whose copies a finished step ran
(PlanRequest.copies_done). A slot is *settled* when its last copies are done; the cache service
touches only settled slots. An L2 victim whose slot is not settled yet is dropped instead of written
down, and a disk hit finds no settled staging slot is left to be recomputed; in synchronous
scheduling every slot is settled at every plan.

An L2 victim's bytes are not copied in the plan (a plan may demote hundreds of blocks, a
millisecond each): its host slot itself goes to the disk tier's writer (DiskTier.write_slot), which
writes the file from it, and the block that displaced the victim takes a *spare* slot (host slots
past the staging ones) instead. So L2's slots (LowerTier's, which its policy is keyed by) are
logical: ``_host_slot`` maps each to the host slot its bytes sit in now, and every copy addresses
the host slot. A slot the writer is done with becomes a spare at the next plan (``begin_plan``).
With no spare slot left the writer is too far behind, and the victim is dropped (like a full write
queue), never copied in the plan.

A loaded block is published in L1 in the plan that loads it (its bytes land before any step reads
it), and L2 drops its copy (LowerTier.keep_on_load False): L1 and L2 hold distinct blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from nanokv.cache_service.kv_events import MEDIUM_OF_LEVEL, KVEventLog
from nanokv.cache_service.manager import KVCacheManager
from nanokv.cache_service.tiers.disk_tier import PENDING, DiskTier
from nanokv.cache_service.tiers.formats import TierFormat
from nanokv.cache_service.tiers.hierarchy import L1, LowerMatch, TieredCache
from nanokv.cache_service.tiers.lower_tier import LowerTier
from nanokv.cache_service.tiers.remote_tier import REMOTE, RemoteTier
from nanokv.cache_service.types import PrefixMatch
from nanokv.messages import COPY_LOAD, COPY_SAVE

L2 = "L2"


class SlotBytes(Protocol):
    """One host slot's bytes across every layer (cache_service/storage.py HostSlots)."""
    slot_bytes: int

    def views(self, slot: int) -> Sequence[memoryview]: ...

    def read(self, slot: int) -> bytes: ...

    def write(self, slot: int, data: bytes) -> None: ...


@dataclass
class TierCounters:
    """What /metrics shows per tier (monotonic, but occupancy and capacity)."""
    hit_tokens: dict[str, int]
    moved_blocks: dict[str, int]  # "L1->L2", "L2->L1", ...
    blocks: dict[str, int]  # resident now
    capacity_blocks: dict[str, int]


class ServingTiers:
    """L1 (the manager's device pool) above a host tier of ``slots`` blocks, as the planner uses it."""

    def __init__(self, manager: KVCacheManager, slots: int, fmt: TierFormat, policy: str = "lru", *,
                 disk: DiskTier | None = None, host: SlotBytes | None = None, staging: int = 0,
                 remote: RemoteTier | None = None, spare: int = 0):
        """disk: L3 below L2; remote: the shared tier below them (remote_tier.py); host: byte access
        to the host segment (L2's `slots` slots, then `staging` slots for disk and remote hits, then
        `spare` slots for L2 blocks whose victim's slot is being written to the disk), which those
        two need."""
        self.l2 = LowerTier(L2, slots, fmt, policy)
        self.disk = disk
        self.remote = remote
        self.host = host
        if (disk is not None or remote is not None) and (host is None or staging < 1):
            raise ValueError("a disk or remote tier needs the host segment's bytes and staging slots")
        if disk is not None and spare < 1:
            raise ValueError("a disk tier needs spare host slots (for L2 blocks while their victim's slot is written)")
        if disk is not None:
            disk.host = host
        self._remote_run: list[bytes] = []  # this admission's blocks from the shared tier, after lm's
        self.remote_hit_tokens = 0
        self.cache = TieredCache(manager, [self.l2] + ([disk.tier] if disk is not None else []), l1_format=fmt)
        self.cache.on_move = self._on_move
        self.cache.on_leave = self._on_leave
        self.block_size = manager.block_size
        self.copies: list[tuple[int, int, int]] = []
        self.staging = list(range(slots, slots + staging))  # free staging slots
        self._host_slot = list(range(slots))  # L2's slot -> the host slot its bytes sit in
        self.spare = list(range(slots + staging, slots + staging + spare))  # free spare slots (settled)
        self._staged: dict[bytes, int] = {}  # this admission's disk hits -> their staging slot
        self._prefetch: dict[bytes, tuple[int, int]] = {}  # disk hits being read -> (staging slot, plan)
        self.loading = False  # the admission `begin` just matched waits for disk reads (not admitted yet)
        self.prefetch_waits = 0  # admissions deferred while their disk hits were read
        self._touched: dict[int, int] = {}  # host slot -> the last plan whose copies touch it
        self.plan_no = 0  # this plan's number (begin_plan)
        self.copies_done = 0  # the last plan whose copies a finished step ran (the gateway says)
        self.unsettled_drops = 0  # L2 victims dropped, not written down: their slot's bytes in flight
        self.staging_misses = 0  # disk hits recomputed for want of a settled staging slot
        if manager.events is not None:
            self._publish_to(manager.events)

    def _publish_to(self, log: KVEventLog) -> None:
        """The lower tiers' block events for a router (cache_service/kv_events.py): every block that
        becomes resident in L2 or L3 or leaves it, by whatever path (a move down, a load that drops
        its copy, a failed disk write, a reset), and each block the shared tier's server took. The
        disk's blocks indexed at start-up are published first, so a snapshot holds them."""
        bs = self.block_size
        for tier in self.cache.tiers:
            medium = MEDIUM_OF_LEVEL.get(tier.name, tier.name)
            for h in tier.keys():
                log.stored(h, None, bs, medium)

            def resident(h: bytes, present: bool, m: str = medium) -> None:
                if present:
                    log.stored(h, None, bs, m)
                else:
                    log.removed(h, m)
            tier.on_resident = resident
        if self.remote is not None:
            self.remote.on_put = lambda h: log.stored(h, None, bs, MEDIUM_OF_LEVEL[REMOTE])

    # ---- a plan's frame ------------------------------------------------------------------------
    def begin_plan(self, copies_done: int) -> None:
        self.plan_no += 1
        self.copies_done = max(self.copies_done, copies_done)
        if self.disk is not None:
            self.disk.drain()
            self.spare.extend(self.disk.take_drained())  # settled: no copy touched them since they left L2
            self._expire_prefetches()

    def _expire_prefetches(self, after: int = 64) -> None:
        """Reads nobody took within `after` plans (the sequence left, or the block left L3): their
        staging slots go back."""
        assert self.disk is not None  # (the caller checked)
        for h, (slot, plan) in list(self._prefetch.items()):
            if self.plan_no - plan > after and self.disk.state(h) != PENDING:
                self.disk.drop_read(h)
                del self._prefetch[h]
                self._touch(slot)
                self.staging.append(slot)

    def settled(self, slot: int) -> bool:
        return self._touched.get(slot, 0) <= self.copies_done

    def _touch(self, slot: int) -> None:
        self._touched[slot] = self.plan_no

    def host_slot(self, block_hash: bytes) -> int | None:
        """The host slot an L2 block's bytes sit in (None: not in L2)."""
        s = self.l2.slot(block_hash)
        return None if s is None else self._host_slot[s]

    def _on_move(self, src: int, dst: int, block_hash: bytes, loc: int, slot: int) -> None:
        if src == 0 and dst == 1:
            host = self._host_slot[slot]
            self.copies.append((COPY_SAVE, loc, host))
            self._touch(host)
        elif src == 1 and dst == 2 and self.disk is not None and self.host is not None:
            # the victim's bytes are in L2's slot `loc`, which the block that displaced it has taken
            # already (its COPY_SAVE is logged next, into whatever host slot `loc` maps to then)
            old = self._host_slot[loc]
            if not self.settled(old):  # its bytes may still be on their way into the slot
                self.unsettled_drops += 1
                self.disk.forget(block_hash)
            elif not self.spare:
                self.disk.shed(block_hash)
            elif self.disk.write_slot(block_hash, old, self._to_remote if self.remote is not None else None):
                self._host_slot[loc] = self.spare.pop()  # `old` is the writer's until it is drained

    def _to_remote(self, block_hash: bytes, slot: int) -> None:
        """(The disk writer's thread) an L2 victim's slot, written to the disk: the shared tier too."""
        assert self.remote is not None and self.host is not None  # (the caller checked)
        self.remote.write(block_hash, self.host.read(slot))

    def _on_leave(self, level: int, block_hash: bytes, loc: int) -> None:
        if level == 2 and self.disk is not None:
            self.disk.remove(block_hash)
        elif level == 1 and self.remote is not None and self.host is not None and loc >= 0:
            host = self._host_slot[loc]
            if self.settled(host):  # an L2 victim no tier below takes: the shared tier may
                self.remote.write(block_hash, self.host.read(host))

    # ---- an admission's prefix below L1 ---------------------------------------------------------
    def begin(self, prefix: PrefixMatch) -> LowerMatch:
        """The chain past L1's hit that L2 holds, pinned until `land` or `cancel`."""
        lm = self.cache.match_lower(prefix)
        self.loading = False
        if self.disk is not None:
            self.loading = self._stage_disk_hits(lm)
        self._remote_run = []
        if self.loading:  # the caller cancels this admission and tries again at a later plan
            self.prefetch_waits += 1
            self.cache.begin_load(lm)
            return lm
        if self.remote is not None and len(lm.sources) == self._chain_room(lm, prefix):
            pass  # the replica's own tiers reach the cap: nothing to ask the shared tier for
        elif self.remote is not None:
            self._stage_remote_hits(lm, prefix)
        self.cache.begin_load(lm)
        return lm

    def _chain_room(self, lm: LowerMatch, prefix: PrefixMatch) -> int:
        """Blocks past L1's hit a prefix may load at most (match_prefix's cap: one token to compute)."""
        n_q = prefix.num_query_tokens
        cap = min(len(lm.block_hashes), (n_q - 1) // self.block_size if n_q else 0)
        return max(0, cap - lm.start)

    def _stage_remote_hits(self, lm: LowerMatch, prefix: PrefixMatch) -> None:
        """Where the replica's own chain ends, ask the shared tier for the next blocks (one round trip)
        and stage the leading run it holds, as far as settled staging slots last."""
        assert self.remote is not None and self.host is not None  # (the caller checked)
        first = lm.start + len(lm.sources)
        want = lm.block_hashes[first:lm.start + self._chain_room(lm, prefix)]
        free = [s for s in self.staging if self.settled(s)]
        for h, data in zip(want[:len(free)], self.remote.read_run(want[:len(free)])):
            slot = free.pop(0)
            self.staging.remove(slot)
            self.host.write(slot, data)
            self._staged[h] = slot
            self._remote_run.append(h)

    def hit_blocks(self, lm: LowerMatch) -> int:
        """Blocks past L1's hit this admission loads: from the replica's tiers, then the shared one."""
        return lm.num_blocks + len(self._remote_run)

    def _stage_disk_hits(self, lm: LowerMatch) -> bool:
        """The disk hits' payloads into settled staging slots, read on the disk tier's reader thread.
        Returns True while some are still being read (the admission waits); once all are in, they
        are this admission's staged blocks. The chain ends at the first block that cannot be had
        (no staging slot, a bad or missing file): the rest of the prompt is computed."""
        assert self.disk is not None and self.host is not None  # (the caller checked)
        disk, host = self.disk, self.host
        hits = [(i, h) for i, (h, lvl) in enumerate(zip(lm.block_hashes[lm.start:], lm.sources)) if lvl == 2]
        waiting = False
        for i, h in hits:
            if h in self._prefetch:
                waiting = waiting or disk.state(h) == PENDING
                continue
            slot = next((s for s in self.staging if self.settled(s)), None)
            if slot is None:
                self.staging_misses += 1
                del lm.sources[i:]
                break
            self.staging.remove(slot)
            self._prefetch[h] = (slot, self.plan_no)
            disk.prefetch(h, slot, host.write)
            waiting = True
        if waiting:
            return True
        for i, h in hits:
            if i >= len(lm.sources):
                break
            slot, _ = self._prefetch.pop(h)
            if not disk.settle(h):  # gone, corrupt or cut short: the chain ends here
                self._touch(slot)
                self.staging.append(slot)
                del lm.sources[i:]
                break
            self._staged[h] = slot
        return False

    def land(self, lm: LowerMatch, table: list[int]) -> int:
        """The sequence got its blocks (`table`, L1's hit first): log a load per block into its
        fresh block. The caller publishes them in L1 (cache_blocks), then calls `finish`. Returns
        the tokens the lower tiers serve (L1's blocks met again along the chain are not theirs)."""
        tiers = self.cache.tiers
        for i, (h, lvl) in enumerate(zip(lm.block_hashes[lm.start:], lm.sources)):
            if not lvl:  # L1's own block, in place (allocate put it there)
                if table[lm.start + i] != lm.l1_blocks[lm.start + i]:
                    raise RuntimeError("an L1 block of the chain is not in its place in the table")
                continue
            slot = self._staged.get(h) if lvl == 2 else self.host_slot(h)
            if slot is None:  # pinned or staged: cannot have left
                raise RuntimeError(f"{tiers[lvl - 1].name}: a block being loaded lost its slot")
            self.copies.append((COPY_LOAD, table[lm.start + i], slot))
            self._touch(slot)
        for j, h in enumerate(self._remote_run):
            slot = self._staged[h]
            self.copies.append((COPY_LOAD, table[lm.start + lm.num_blocks + j], slot))
            self._touch(slot)
        return (self.hit_blocks(lm) - lm.sources.count(0)) * self.block_size

    def from_remote(self) -> int:
        """Tokens of this admission the shared tier serves."""
        return len(self._remote_run) * self.block_size

    def from_disk(self, lm: LowerMatch) -> int:
        """Tokens of `lm` the disk tier serves."""
        return sum(lvl == 2 for lvl in lm.sources) * self.block_size

    def finish(self, lm: LowerMatch) -> None:
        self.cache.finish_load(lm)
        if self._remote_run:
            n = self.from_remote()
            self.remote_hit_tokens += n
            self.cache.stats.add(self.cache.stats.hit_tokens, REMOTE, n)
            self.cache.stats.add(self.cache.stats.moved, f"{REMOTE}->L1", len(self._remote_run))
        self._remote_run = []
        self._unstage()

    def cancel(self, lm: LowerMatch) -> None:
        self.cache.cancel_load(lm)
        self._remote_run = []
        self._unstage()

    def _unstage(self) -> None:
        """Staging slots go back (reused once their copies are done: settled)."""
        for slot in self._staged.values():
            self._touch(slot)
            self.staging.append(slot)
        self._staged.clear()

    def take_copies(self) -> list[tuple[int, int, int]]:
        out, self.copies = self.copies, []
        return out

    # ---- administration ---------------------------------------------------------------------------
    def clear(self) -> int:
        """Drop every unpinned L2 copy (reset_prefix_cache); returns how many. The disk keeps its
        files: it is the tier that outlives restarts."""
        return sum(self.l2.discard(h) for h in self.l2.keys())

    def pinned(self) -> int:
        """L2 blocks pinned by loads (0 between plans: a plan lands or cancels every load it begins)."""
        return len(self.l2) - self.l2.num_evictable

    def counters(self) -> TierCounters:
        st = self.cache.stats
        return TierCounters(dict(st.hit_tokens), dict(st.moved), self.cache.occupancy(), self.cache.capacity())

    def block_bytes(self) -> dict[str, int]:
        """Bytes a block occupies in each lower tier (its format), by tier name."""
        out = {self.l2.name: self.l2.format.bytes_per_block}
        if self.disk is not None:
            out[self.disk.tier.name] = self.disk.tier.format.bytes_per_block
        if self.remote is not None:
            out[REMOTE] = self.l2.format.bytes_per_block
        return out

    def remote_stats(self) -> dict[str, int]:
        """The shared tier's store counters (remote_tier_*) and the serving path's own."""
        if self.remote is None:
            return {}
        return {**self.remote.store.counters(),
                "remote_tier_queue_full_total": self.remote.queue_full,
                "remote_tier_available": int(self.remote.store.available)}

    def disk_stats(self) -> dict[str, int]:
        """The disk store's counters and gauges (disk_tier_*), and the serving path's own."""
        if self.disk is None:
            return {}
        return {**self.disk.store.stats(), "disk_tier_write_failed_total": self.disk.write_failed,
                "disk_tier_read_failed_total": self.disk.read_failed,
                "disk_tier_unsettled_drops_total": self.unsettled_drops,
                "disk_tier_queue_full_total": self.disk.queue_full,
                "disk_tier_draining_slots": self.disk.draining(),
                "disk_tier_staging_misses_total": self.staging_misses,
                "disk_tier_prefetch_waits_total": self.prefetch_waits}

__all__ = ["L1", "L2", "ServingTiers", "SlotBytes", "TierCounters"]
