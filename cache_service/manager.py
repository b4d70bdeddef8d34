"""KVCacheManager: prefix matching, block tables, allocation and the cache counters.

The scheduler drives it (and so does ``nanokv simulate``, through the same methods):

    m = cm.match_prefix(prompt_ids, cache_salt)        # read-only
    table = cm.allocate(seq_id, len(prompt_ids), m)   # pins the hit, allocates the rest, or None
    ... run tokens ...; cm.cache_blocks(seq_id, ids, num_computed)   # publish computed blocks
    cm.grow(seq_id, n)                                # decode needs more slots
    cm.free(seq_id)                                   # hashed blocks stay cached (evictable)

Nothing here scans all blocks per step: work is proportional to the blocks a call touches.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanokv.cache_service.block_pool import BlockPool
from nanokv.cache_service.hashing import HASH_ALGOS, hash_full_blocks
from nanokv.cache_service.kv_events import L1
from nanokv.cache_service.policies import make_policy
from nanokv.cache_service.types import CacheStats, PrefixMatch
from nanokv.errors import NanoKVError

if TYPE_CHECKING:
    from nanokv.cache_service.kv_events import KVEventLog


@dataclass
class _Seq:
    table: list[int]  # >= 0 pool block ids; -1 a hole (dropped); <= -2 external (replace_with_external)
    hashes: list[bytes]  # known full-block hashes (from match_prefix, extended by cache_blocks)
    num_cached: int  # leading blocks already published (registered, or found cached elsewhere)
    first_hole: int  # logical index of the first dropped or external block (_NO_HOLE when none)
    changed: int = 1 << 62  # lowest entry changed in place since changed_from() last asked (_NO_HOLE: none)


_NO_HOLE = 1 << 62
__all__ = ["CacheStats", "KVCacheManager", "PrefixMatch"]


def _check_int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise NanoKVError(name, f"got {value!r}; must be an integer >= {lo}")
    return value


def _check_index(name: str, i: object, n: int) -> None:
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
        raise NanoKVError(name, f"index {i!r} outside the block table (0..{n - 1})")


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        eviction_policy: str = "clock",
        lru_k: int = 2,
        hash_algo: str = "sha256",
        policy_kwargs: dict[str, Any] | None = None,
    ) -> None:
        _check_int("num_blocks", num_blocks, 1)
        _check_int("block_size", block_size, 1)
        if isinstance(lru_k, bool) or lru_k not in (2, 3):
            raise NanoKVError("lru_k", f"got {lru_k!r}; allowed values: 2, 3")
        if hash_algo not in HASH_ALGOS:
            allowed = ", ".join(HASH_ALGOS)
            raise NanoKVError("prefix_caching_hash_algo", f"got {hash_algo!r}; allowed: {allowed}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.hash_algo = hash_algo
        self.lru_k = lru_k
        self.policy_name = eviction_policy
        self._policy_kwargs: dict[str, Any] = {"k": lru_k, **(policy_kwargs or {})}
        self.pool = BlockPool(num_blocks, make_policy(eviction_policy, num_blocks, **self._policy_kwargs))
        self.stats = CacheStats(evictions_by_policy={eviction_policy: 0})
        self._seqs: dict[Hashable, _Seq] = {}
        self._external_release: Callable[[int], None] | None = None  # see set_external_release
        self.events: KVEventLog | None = None  # see set_event_log

    # ---- gauges ------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free plus evictable (cached but unreferenced)."""
        return self.pool.num_allocatable()

    def num_used_blocks(self) -> int:
        return self.pool.num_used

    def num_cached_blocks(self) -> int:
        return len(self.pool.index)

    def usage(self) -> float:
        return self.pool.num_used / self.num_blocks

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The live block table (updated in place by grow/drop_blocks); treat it as read-only."""
        return self._seq(seq_id).table

    def changed_from(self, seq_id: Hashable) -> int | None:
        """The lowest table entry changed in place (drop_blocks, replace_with_external) since the
        last call, or None; growth at the end is not counted. Lets a table's copy elsewhere (the
        compute service's) be updated by the entries that changed."""
        seq = self._seq(seq_id)
        i, seq.changed = seq.changed, _NO_HOLE
        return None if i == _NO_HOLE else i

    def has_seq(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    # ---- prefix lookup -------------------------------------------------------------------------
    def match_prefix(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        block_hashes: Sequence[bytes] | None = None,
    ) -> PrefixMatch:
        """Longest run of cached full blocks of ``token_ids``, leaving at least one token to compute.

        No state change and no counters. ``block_hashes`` (e.g. from an earlier match) skips hashing;
        when given, ``cache_salt`` is ignored because the hashes already embed it.
        """
        n_tokens = len(token_ids)
        bs = self.block_size
        if not self.enable_prefix_caching:
            return PrefixMatch([], 0, [], n_tokens)
        n_full = n_tokens // bs
        if block_hashes is None:
            hashes = hash_full_blocks(token_ids, bs, cache_salt, self.hash_algo)
        else:
            hashes = list(block_hashes[:n_full])
        index = self.pool.index
        ids: list[int] = []
        for h in hashes[: (n_tokens - 1) // bs if n_tokens else 0]:  # cap: one token left to compute
            b = index.get(h)
            if b is None:
                break
            ids.append(b)
        return PrefixMatch(ids, len(ids) * bs, hashes, n_tokens)

    # ---- allocation ------------------------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(
        self, seq_id: Hashable, num_tokens: int, prefix: PrefixMatch | None = None,
        resident: dict[int, int] | None = None,
    ) -> list[int] | None:
        """First allocation of a sequence: pin the (still valid part of the) prefix hit, then add fresh
        blocks until ``num_tokens`` tokens are covered. None, with no state change, if short.
        ``resident`` ({position: block}, past the hit; the hierarchy's match gives it) are cached
        blocks of later positions of the prompt, reached again through blocks a lower tier loads:
        they take their place in the table, pinned, instead of fresh blocks."""
        if seq_id in self._seqs:
            raise NanoKVError("seq_id", f"sequence {seq_id!r} already holds blocks; free it first")
        _check_int("num_tokens", num_tokens, 0)
        pool = self.pool
        hit: list[int] = []
        hashes: list[bytes] = []
        if prefix is not None and self.enable_prefix_caching:
            hashes = list(prefix.block_hashes)
            # The match may be stale (blocks evicted since): keep the leading run that still holds
            # the expected hash, and never more full blocks than num_tokens covers.
            limit = min(len(prefix.block_ids), num_tokens // self.block_size, len(hashes))
            for i in range(limit):
                b = prefix.block_ids[i]
                if pool.hash[b] != hashes[i]:
                    break
                hit.append(b)
        total = self._blocks_for(num_tokens)
        later: dict[int, int] = {}
        if resident and len(hit) == len(prefix.block_ids if prefix is not None else ()):
            for i, b in resident.items():
                if len(hit) <= i < min(total, len(hashes)) and pool.hash[b] == hashes[i]:
                    later[i] = b
            if len(later) != len(resident):  # the caller matched them moments ago: a bookkeeping error
                raise RuntimeError(f"resident blocks {sorted(resident)} are no longer all cached")
        need = total - len(hit) - len(later)
        pinned_now = sum(1 for b in (*hit, *later.values()) if pool.ref[b] == 0)  # stop being allocatable
        if need > pool.num_allocatable() - pinned_now:
            return None
        st = self.stats
        # Blocks right after the hit that we evicted recently: their tokens are computed again.
        # (Checked before allocating, whose own evictions must not push them out of the memory.)
        recent = pool.recently_evicted
        for h in hashes[len(hit):]:
            if h not in recent:
                break
            st.recomputed_tokens += self.block_size
        for b in (*hit, *later.values()):
            pool.pin(b)
        fresh = iter(self._take(need))
        table = hit + [later[i] if i in later else next(fresh) for i in range(len(hit), total)]
        self._seqs[seq_id] = _Seq(table, hashes, len(hit), _NO_HOLE)
        st.prefix_queries += 1
        st.prefix_queries_tokens += prefix.num_query_tokens if prefix is not None else num_tokens
        st.prefix_hits_tokens += (len(hit) + len(later)) * self.block_size
        return table

    def _take(self, n: int) -> list[int]:
        before = self.pool.evictions
        out = self.pool.take(n)
        self._count_evictions(self.pool.evictions - before)
        self.stats.blocks_allocated += n
        return out

    def _count_evictions(self, evicted: int) -> None:
        if evicted:
            self.stats.evictions += evicted
            by = self.stats.evictions_by_policy
            by[self.policy_name] = by.get(self.policy_name, 0) + evicted

    def can_grow(self, seq_id: Hashable, num_tokens: int) -> bool:
        need = self._blocks_for(num_tokens) - len(self._seq(seq_id).table)
        return need <= self.pool.num_allocatable()

    def grow(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Extend the table to cover ``num_tokens`` tokens. False, with no state change, if short."""
        _check_int("num_tokens", num_tokens, 0)
        seq = self._seq(seq_id)
        need = self._blocks_for(num_tokens) - len(seq.table)
        if need <= 0:
            return True
        if need > self.pool.num_allocatable():
            return False
        seq.table.extend(self._take(need))
        return True

    # ---- publishing computed blocks ------------------------------------------------------------
    def cache_blocks(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        cache_salt: str | None = None,
    ) -> None:
        """Register the hashes of this sequence's full blocks whose KV is computed. Incremental and
        idempotent. If a hash is already cached in another block, that mapping wins and this block
        stays private (the other block still counts as used again: the policy hears a hit)."""
        if not self.enable_prefix_caching:
            return
        seq = self._seq(seq_id)
        bs = self.block_size
        n_full = min(num_computed_tokens, len(token_ids)) // bs
        n_full = min(n_full, seq.first_hole, len(seq.table))
        if n_full <= seq.num_cached:
            return
        if len(seq.hashes) < n_full:
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes.extend(
                hash_full_blocks(token_ids, bs, cache_salt, self.hash_algo, parent=parent,
                                 start_block=len(seq.hashes), max_blocks=n_full)
            )
        pool = self.pool
        for i in range(seq.num_cached, n_full):
            b = seq.table[i]
            h = seq.hashes[i]
            if pool.hash[b] == h:
                continue
            if pool.register(b, h, i):
                self.stats.blocks_cached += 1
                if self.events is not None:
                    self.events.stored(h, seq.hashes[i - 1] if i else b"", bs)
            else:
                other = pool.index[h]
                if other != b:
                    pool.touch(other)
        seq.num_cached = n_full

    # ---- release ---------------------------------------------------------------------------------
    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's blocks tail first, so deeper blocks become evictable first and a
        prompt's root is the most recently released (LRU-like policies then evict leaves first).
        External entries (<= -2, see replace_with_external) go back to their owner after that."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        pool = self.pool
        tail = 0  # cached blocks after this one: tells policies which block was the sequence's end
        for b in reversed(seq.table):
            if b >= 0:
                cached = pool.hash[b] is not None
                pool.release(b, tail if cached else -1)
                tail += cached
        for b in seq.table:
            if b <= -2:
                self._release_external(b)

    def drop_blocks(self, seq_id: Hashable, logical_indices: Iterable[int]) -> None:
        """Sparsity: release these blocks now (pool blocks to the pool, external entries to their
        owner); their table entries become holes (-1). Blocks after the first hole are never
        published to the prefix cache."""
        seq = self._seq(seq_id)
        for i in logical_indices:
            _check_index("logical_indices", i, len(seq.table))
            b = seq.table[i]
            if b == -1:
                continue
            seq.table[i] = -1
            seq.first_hole = min(seq.first_hole, i)
            seq.changed = min(seq.changed, i)
            if b >= 0:
                self.pool.release(b)
            else:
                self._release_external(b)

    # ---- external entries (hybrid sparsity: blocks moved into the INT4 demotion store) -----------
    def set_external_release(self, release: Callable[[int], None] | None) -> None:
        """Who takes back an external entry (a code <= -2) when its sequence drops it, finishes, is
        aborted or preempted: release(code) is called exactly once per code put into a table."""
        self._external_release = release

    def held_alone(self, seq_id: Hashable, logical_indices: Iterable[int]) -> list[int]:
        """Those of the logical indices whose entry is a pool block referenced by this sequence only
        (moving a prefix-shared block out would free nothing: its other holders keep it)."""
        seq = self._seq(seq_id)
        ref = self.pool.ref
        return [i for i in logical_indices if 0 <= i < len(seq.table) and seq.table[i] >= 0
                and ref[seq.table[i]] == 1]

    def replace_with_external(self, seq_id: Hashable, logical_index: int, code: int) -> int:
        """Sparsity (hybrid): the caller copied block `logical_index` elsewhere (the INT4 demotion
        store) and names the copy by `code` (<= -2; -1 is a hole). The pool block is released now,
        like a dropped one: its content is intact, so a hash it holds stays cached (an exact prefix),
        and, like a hole, it stops publication of every later block (they were computed against the
        copy). The entry stays readable, through `code`. Returns the released block id."""
        if self._external_release is None:
            raise NanoKVError("code", "no owner for external entries; call set_external_release first")
        if isinstance(code, bool) or not isinstance(code, int) or code > -2:
            raise NanoKVError("code", f"got {code!r}; external codes are integers <= -2 (-1 is a hole)")
        seq = self._seq(seq_id)
        _check_index("logical_index", logical_index, len(seq.table))
        b = seq.table[logical_index]
        if b < 0:
            raise NanoKVError("logical_index", f"entry {logical_index} is {b}, not a pool block")
        seq.table[logical_index] = code
        seq.first_hole = min(seq.first_hole, logical_index)
        seq.changed = min(seq.changed, logical_index)
        self.pool.release(b)
        return b

    def _release_external(self, code: int) -> None:
        if self._external_release is None:  # only replace_with_external puts codes in, and it checks
            raise RuntimeError(f"external entry {code} without an owner")
        self._external_release(code)

    # ---- counters the scheduler reports --------------------------------------------------------
    def record_recompute(self, num_tokens: int) -> None:
        self.stats.recomputed_tokens += _check_int("num_tokens", num_tokens, 0)

    def record_preemption(self) -> None:
        self.stats.preemptions += 1

    # ---- administration ------------------------------------------------------------------------
    def set_policy(self, name: str, donor: KVCacheManager | None = None, **kw: Any) -> None:
        """Switch the eviction policy at runtime. Every cached block stays cached; the new policy
        receives the evictable blocks coldest first with their "was reused" bit (O(cached)).
        ``donor``: a manager running ``name`` on the same request stream (the adaptive controller's
        ghost); the switch then starts warm, with the donor's order and history (BlockPool.replace_policy)."""
        kwargs = {"k": self.lru_k, **kw}
        new = make_policy(name, self.num_blocks, **kwargs)
        self.pool.replace_policy(new, donor.pool if donor is not None else None)
        self.policy_name = name
        self._policy_kwargs = kwargs
        self.stats.evictions_by_policy.setdefault(name, 0)

    def resize(self, num_blocks: int) -> int:
        """Grow the pool to ``num_blocks`` (new ids [N, num_blocks), free) or shrink it by removing
        the highest ids, as far as referenced blocks allow; cached blocks among them are evicted
        (counted in the eviction stats). Returns the new block count. The caller resizes the KV
        tensors to match (nanokv.compute_service.adaptive.pool): block ids below the new count keep their data."""
        _check_int("num_blocks", num_blocks, 1)
        pool = self.pool
        if num_blocks >= pool.num_blocks:
            pool.grow(num_blocks)
        else:
            before = pool.evictions
            pool.shrink(num_blocks)
            self._count_evictions(pool.evictions - before)
        self.num_blocks = pool.num_blocks
        return self.num_blocks

    def set_evict_hook(self, hook: Callable[[int, bytes, int], None] | None) -> None:
        """``hook(block, hash, depth)`` hears of every cached block evicted (a policy victim, or removed
        by a shrink) while the block still holds its content: the lower tiers (cache_service/tiers)
        take it. None removes the hook."""
        self.pool.on_evict = hook

    def set_event_log(self, log: KVEventLog | None) -> None:
        """Publish block events (stored, removed, all cleared) to ``log`` (cache_service/kv_events.py)
        from now on; None stops it. Independent of set_evict_hook."""
        self.events = log
        self.pool.on_removed = log.removed if log is not None else None

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block. Refused (False) while any block is in use."""
        if self.pool.num_used:
            return False
        self.pool.drop_evictable()
        if self.events is not None:
            self.events.cleared(L1)
        self.pool.policy = make_policy(self.policy_name, self.num_blocks, **self._policy_kwargs)
        return True

    def _seq(self, seq_id: Hashable) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise NanoKVError("seq_id", f"unknown sequence {seq_id!r}")
        return seq
