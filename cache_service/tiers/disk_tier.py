"""L3 in the serving path: the disk store's files under a tier policy, fed from and read into host slots.

The DiskStore (disk_store.py) keeps verified block files under a byte budget; the LowerTier here
decides which blocks stay (its own policy, like every tier) and the hierarchy moves blocks in and
out of it. Bytes reach the disk only through host memory the cache service owns: an L2 victim is
written from its L2 slot, and a hit is read into a staging slot of the host segment, which the
compute service then copies into the device pool like an L2 hit (serving.py). At start-up the
store's files (already checked by its re-index) are admitted least recently used first, so the
tier's policy starts from the order the files were last used in.
"""

from __future__ import annotations

import logging

from nanokv.cache_service.tiers.disk_store import DiskStore
from nanokv.cache_service.tiers.formats import TierFormat
from nanokv.cache_service.tiers.lower_tier import LowerTier
from nanokv.errors import ConfigError

log = logging.getLogger("nanokv.cache_service.tiers")
L3 = "L3"


class DiskTier:
    def __init__(self, store: DiskStore, payload_bytes: int, bits: int, policy: str = "lru"):
        self.store = store
        self.payload_bytes = payload_bytes
        capacity = store.capacity_bytes // store.charge(payload_bytes)
        if capacity < 1:
            raise ConfigError("disk_cache_bytes", f"{store.capacity_bytes} bytes hold no block file of "
                                                  f"{store.charge(payload_bytes)} bytes")
        self.tier = LowerTier(L3, capacity, TierFormat("pool", bits, payload_bytes), policy, keep_on_load=True)
        self.write_failed = 0  # victims L2 could not write down (disk full, I/O error, bytes in flight)
        self.read_failed = 0  # hits whose file was gone, corrupt or slow: recomputed instead
        kept = 0
        for e in store.entries():  # least recently used first
            if e.payload_bytes != payload_bytes:
                store.remove(e.block_hash)  # another layout's block (same fingerprint cannot say so)
                continue
            admitted, victim = self.tier.admit(e.block_hash, 0)
            if victim is not None:  # more files than this budget's blocks: the oldest go
                store.remove(victim[0])
            kept += admitted
        if kept:
            log.info("disk tier (L3): %d blocks indexed from %s", kept, store.dir)

    def write(self, block_hash: bytes, payload: bytes) -> bool:
        """Put a block the tier admitted; on failure the tier forgets it (False)."""
        if self.store.put(block_hash, payload):
            return True
        self.forget(block_hash)
        return False

    def forget(self, block_hash: bytes) -> None:
        """The tier's copy cannot be had (not written, or unreadable): drop it from the index."""
        self.write_failed += 1
        self.tier.discard(block_hash)

    def read(self, block_hash: bytes) -> bytes | None:
        data = self.store.get(block_hash)
        if data is None or len(data) != self.payload_bytes:
            self.read_failed += 1
            self.tier.discard(block_hash)
            self.store.remove(block_hash)
            return None
        return data

    def remove(self, block_hash: bytes) -> None:
        """The tier evicted or dropped the block: its file goes."""
        self.store.remove(block_hash)
