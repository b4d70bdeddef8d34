"""The lower tiers' counters in the cache service's stats (CacheServiceStats: tier_* maps)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanokv.cache_service.tiers.serving import ServingTiers
    from nanokv.messages import CacheServiceStats


def add_tier_stats(out: CacheServiceStats, tiers: ServingTiers) -> None:
    """Hit tokens, resident and capacity blocks per tier ("L1", "L2", ...), and blocks moved per
    direction ("L1->L2", "L2->L1")."""
    c = tiers.counters()
    out["tier_hit_tokens"] = c.hit_tokens
    out["tier_blocks"] = c.blocks
    out["tier_capacity_blocks"] = c.capacity_blocks
    out["tier_moved_blocks"] = c.moved_blocks
    # a move's bytes: its blocks in the format of the lower of its two tiers (what crossed the link)
    size = tiers.block_bytes()
    out["tier_moved_bytes"] = {move: n * max((size.get(t, 0) for t in move.split("->")), default=0)
                               for move, n in c.moved_blocks.items()}
    out["tier_health"] = {**tiers.disk_stats(), **tiers.remote_stats()}
