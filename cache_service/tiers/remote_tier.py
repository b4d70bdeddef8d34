"""The shared tier in the serving path: blocks in a Valkey/Redis server that several replicas share
(``remote_cache_url``), below the replica's own tiers.

Unlike L2 and L3 it has no local index: other replicas write to it, so what it holds is learnt by
asking. When a prefix's chain ends in the replica's own tiers, the next blocks are asked for in one
round trip (``RemoteStore.get_many``); the leading run that comes back is read into staging slots and
loaded into L1 like a disk hit (serving.py). Writes are L2's victims (whether or not L3 takes them
too), put by a writer thread with a TTL. With a disk tier the disk writer hands them over after writing
the file from the victim's own slot; without one a plan copies the bytes out of their settled slot. A
down or slow server is skipped by the store itself (remote_store.py: a miss, a counter, one warning
per change of state), so a request never waits on it for longer than the store's timeout.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanokv.cache_service.tiers.remote_store import RemoteStore

REMOTE = "remote"


class RemoteTier:
    def __init__(self, store: RemoteStore, payload_bytes: int, max_queue: int = 256):
        self.store = store
        self.payload_bytes = payload_bytes
        self.queue_full = 0  # victims not offered to the server: the writer was too far behind
        self.short_reads = 0  # values of the wrong size (another layout under the same fingerprint)
        self.on_put: Callable[[bytes], None] | None = None  # a block the server took (the writer's thread)
        self._q: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(maxsize=max_queue)
        self._writer = threading.Thread(target=self._write_loop, name="nanokv-remote-tier", daemon=True)
        self._writer.start()

    def write(self, block_hash: bytes, payload: bytes) -> None:
        try:
            self._q.put_nowait((block_hash, payload))
        except queue.Full:
            self.queue_full += 1

    def read_run(self, block_hashes: list[bytes]) -> list[bytes]:
        """The payloads of the leading run of `block_hashes` the server holds (one round trip)."""
        if not block_hashes or not self.store.available:
            return []
        out: list[bytes] = []
        for data in self.store.get_many(block_hashes):
            if data is None:
                break
            if len(data) != self.payload_bytes:
                self.short_reads += 1
                break
            out.append(data)
        return out

    def _write_loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            if self.store.put(*job) and self.on_put is not None:
                self.on_put(job[0])

    def close(self) -> None:
        """Offer the queued writes, stop the writer, close the connection."""
        self._q.put(None)
        self._writer.join(timeout=30)
        self.store.close()
