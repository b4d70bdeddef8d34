"""The manager's public records: what a prefix lookup returns and the counters it keeps."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class PrefixMatch:
    block_ids: list[int]  # cached blocks covering the prefix (full blocks only)
    num_tokens: int  # = len(block_ids) * block_size
    block_hashes: list[bytes]  # hashes of ALL full blocks of the queried tokens (reuse them later)
    num_query_tokens: int = 0  # prompt length that was queried (the hit-ratio denominator)


@dataclass
class CacheStats:
    """Monotonically increasing counters; metrics code only reads them."""

    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    prefix_queries: int = 0  # number of allocate() calls (prompts admitted)
    evictions: int = 0  # blocks
    evictions_by_policy: dict[str, int] = field(default_factory=dict)
    recomputed_tokens: int = 0  # tokens recomputed because their blocks were evicted or preempted
    preemptions: int = 0
    blocks_allocated: int = 0  # fresh blocks handed out (prefix hits excluded)
    blocks_cached: int = 0  # blocks that got a hash registered

    def clear(self) -> None:
        """Every counter back to zero, in place (metrics code may hold this object), the policies'
        keys kept. Only before serving starts (the engine's warm-up): afterwards they only grow."""
        for f in fields(self):
            if f.name != "evictions_by_policy":
                setattr(self, f.name, 0)
        self.evictions_by_policy = dict.fromkeys(self.evictions_by_policy, 0)

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0
