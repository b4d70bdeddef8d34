"""The KV cache manager: block pool, prefix hashing, eviction policies, trace replay.

Pure Python (stdlib only) so that the scheduler, the simulator and the property tests all run the
exact same code without torch.
"""

from nanokv.cache_service.manager import CacheStats, KVCacheManager, PrefixMatch
from nanokv.cache_service.policies import POLICY_NAMES, EvictionPolicy, make_policy

__all__ = ["CacheStats", "EvictionPolicy", "KVCacheManager", "POLICY_NAMES", "PrefixMatch", "make_policy"]
