"""One replica as the router sees it: its addresses, health, load, and the index of the blocks its
cache holds, rebuilt from its KV-event stream (nanokv.events.v1.KvEvents, relayed by its gateway)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from nanokv.errors import NanoKVError
from nanokv.protos import kv_events_pb2 as pb

# a block's worth by the medium that holds it (the events' vLLM values; cache_service/kv_events.py):
# the share of its prefill a hit there saves. The device pool's costs nothing to use; a host block
# must be copied up (tens of GB/s), a disk block read first, a shared-tier block fetched over the
# network. L1/L2/L3: what replicas of an older build name the same tiers.
TIER_WEIGHT = {"GPU": 1.0, "CPU": 0.8, "DISK": 0.5, "REMOTE": 0.3, "L1": 1.0, "L2": 0.8, "L3": 0.5}
DEFAULT_MEDIUM = "GPU"  # an event without one (vLLM's None)
UNKNOWN_WEIGHT = 0.1  # a medium this router does not know
ROUTED_TTL_S = 2.0
ROUTED_MAX = 50_000  # past it, expired entries are dropped on the next insert


@dataclass(frozen=True)
class ReplicaAddress:
    host: str
    http_port: int
    grpc_port: int

    @property
    def name(self) -> str:
        return f"{self.host}:{self.http_port}:{self.grpc_port}"

    def _host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def grpc_target(self) -> str:
        return f"{self._host()}:{self.grpc_port}"

    @property
    def http_base(self) -> str:
        return self.http_url(False)

    def http_url(self, tls: bool) -> str:
        return f"{'https' if tls else 'http'}://{self._host()}:{self.http_port}"


def _port(text: str, what: str, flag: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise NanoKVError(flag, f"{what} {text!r} is not a port (1 to 65535)")
    return port


def parse_replica(spec: str, flag: str = "replicas") -> ReplicaAddress:
    """HOST:HTTP_PORT:GRPC_PORT (an IPv6 host in brackets: [::1]:8000:50051)."""
    host, sep, rest = spec.strip().rpartition(":")
    host, sep2, http = host.rpartition(":")
    if not (sep and sep2 and host):
        raise NanoKVError(flag, f"got {spec!r}; expected HOST:HTTP_PORT:GRPC_PORT")
    return ReplicaAddress(host.strip("[]"), _port(http, "HTTP port", flag), _port(rest, "gRPC port", flag))


def parse_replicas(text: str | None) -> list[ReplicaAddress]:
    return [parse_replica(s) for s in (text or "").split(",") if s.strip()]


@dataclass
class Replica:
    address: ReplicaAddress
    channel: grpc.aio.Channel
    http_base: str = ""  # http:// or https://HOST:PORT (the pool's TLS setting)
    healthy: bool = False
    last_error: str = ""  # why its last check failed ("" once it passes): callers' 503s and the log say it
    # load from GetServerInfo, and what the router itself has sent there and not seen end
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    inflight: int = 0
    others: int = 0  # sequences there beyond this router's, at the last check
    # the index: medium -> block hashes cached there, and where its event stream stands
    blocks: dict[str, set[bytes]] = field(default_factory=dict)
    stream_id: str = ""
    last_seq: int = 0
    hash_algo: str = "sha256"
    block_size: int = 0
    shared_media: frozenset[str] = frozenset()  # media every replica can load from (the shared tier)
    events_seen: int = 0
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set while unhealthy: its streams end
    failures: int = 0  # checks failed in a row
    # blocks of prompts just sent here, until their BlockStored events can have come: a conversation's
    # next turn, sent the moment its answer ends, finds its prefix here, not on the least loaded replica
    routed: dict[bytes, float] = field(default_factory=dict)  # hash -> monotonic expiry

    def __post_init__(self) -> None:
        if not self.http_base:
            self.http_base = self.address.http_base

    @property
    def name(self) -> str:
        return self.address.name

    def mark(self, healthy: bool, dead: bool = True) -> None:
        """Up or down for new requests. ``dead`` (it refused a connection, or failed checks in a row)
        also ends the streams running there; a replica that was only slow to answer keeps them."""
        if healthy:
            self.failures = 0
            if self.down.is_set():
                self.down = asyncio.Event()
        else:
            self.failures += 1
            if dead:
                self.down.set()
        self.healthy = healthy

    # ---- the index -------------------------------------------------------------------------------
    def apply(self, batch: pb.KvEventBatch) -> None:
        """One batch of its KV-event stream (a snapshot first drops everything known)."""
        if batch.snapshot:
            self.blocks.clear()
        if batch.block_size:
            self.block_size = batch.block_size
        if batch.hash_algo:
            self.hash_algo = batch.hash_algo
        if batch.shared_media:
            self.shared_media = frozenset(batch.shared_media)
        blocks = self.blocks
        for e in batch.events:
            kind = e.WhichOneof("event")
            if kind == "stored":
                blocks.setdefault(e.stored.medium or DEFAULT_MEDIUM, set()).update(e.stored.block_hashes)
            elif kind == "removed":
                s = blocks.get(e.removed.medium or DEFAULT_MEDIUM)
                if s is not None:
                    s.difference_update(e.removed.block_hashes)
            elif kind == "cleared":
                if e.cleared.medium:
                    blocks.pop(e.cleared.medium, None)
                else:
                    blocks.clear()
        self.events_seen += len(batch.events)
        self.stream_id, self.last_seq = batch.stream_id, batch.last_seq

    def expect(self, hashes: Sequence[bytes], ttl_s: float = ROUTED_TTL_S) -> None:
        now = time.monotonic()
        routed = self.routed
        if len(routed) > ROUTED_MAX:
            for h in [h for h, t in routed.items() if t < now]:
                del routed[h]
        until = now + ttl_s
        for h in hashes:
            routed[h] = until

    def num_blocks_indexed(self) -> int:
        return sum(len(s) for s in self.blocks.values())

    def shared_sets(self) -> list[set[bytes]]:
        """The blocks this replica put in a shared tier: every replica sharing it can load them."""
        return [s for m, s in self.blocks.items() if m in self.shared_media and s]

    def cached_prefix(self, hashes: Sequence[bytes], shared: Sequence[set[bytes]] = ()) -> tuple[int, float]:
        """(blocks of the longest cached prefix, their worth weighted by tier): a walk of set probes.
        ``shared``: the shared tier's blocks as every replica published them; one found only there
        counts the same on every replica (it continues the walk, and attracts nothing here)."""
        own = self.shared_media
        tiers = [(TIER_WEIGHT.get(m, UNKNOWN_WEIGHT), s) for m, s in self.blocks.items() if s and m not in own]
        tiers.sort(key=lambda t: -t[0])
        shared_w = TIER_WEIGHT["REMOTE"]
        n, worth, now, routed = 0, 0.0, time.monotonic(), self.routed
        for h in hashes:
            w = next((w for w, s in tiers if h in s), None)
            if w is None:
                if routed.get(h, 0.0) >= now:
                    w = 1.0
                elif any(h in s for s in shared):
                    w = shared_w
                else:
                    break
            n, worth = n + 1, worth + w
        return n, worth
