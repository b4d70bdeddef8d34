"""nanokv.events.v1.KvEvents on the cache service: the event log (kv_events.py) as a resumable
server stream. The gateway's public server relays the same messages (gateway/grpc_api/kv_events.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from nanokv.cache_service.kv_events import CLEARED, SHARED_MEDIA, STORED, Catchup, KVEvent, KVEventLog
from nanokv.protos import kv_events_pb2 as pb

BATCH_EVENTS = 2048  # per message: a snapshot of many blocks stays well under gRPC's 4 MiB limit
WAIT_S = 0.5  # how often a quiet stream looks whether its caller is still there


def event_to_pb(e: KVEvent) -> pb.KvEvent:
    if e.kind == STORED:
        return pb.KvEvent(seq=e.seq, stored=pb.BlockStored(block_hashes=e.block_hashes, parent_block_hash=e.parent,
                                                           token_count=e.token_count, medium=e.medium))
    if e.kind == CLEARED:
        return pb.KvEvent(seq=e.seq, cleared=pb.AllBlocksCleared(medium=e.medium))
    return pb.KvEvent(seq=e.seq, removed=pb.BlockRemoved(block_hashes=e.block_hashes, medium=e.medium))


def catchup_to_pb(log: KVEventLog, c: Catchup) -> Iterator[pb.KvEventBatch]:
    """One Catchup as batches of at most BATCH_EVENTS events: only the first says snapshot."""
    for i in range(0, max(len(c.events), 1), BATCH_EVENTS):
        part = c.events[i:i + BATCH_EVENTS]
        last = part[-1].seq if part and not c.snapshot else c.last_seq
        yield pb.KvEventBatch(stream_id=c.stream_id, snapshot=c.snapshot and i == 0, last_seq=last, ts=time.time(),
                              block_size=log.block_size, hash_algo=log.hash_algo, shared_media=SHARED_MEDIA,
                              events=[event_to_pb(e) for e in part])


def stream(log: KVEventLog, request: pb.SubscribeRequest, active: Callable[[], bool]) -> Iterator[pb.KvEventBatch]:
    """The blocking form (a thread-pool gRPC server): catch up, then wait for new events while
    ``active()`` (the call is still wanted)."""
    stream_id, after = request.stream_id, request.after_seq
    while active():
        c = log.read(after, stream_id, BATCH_EVENTS)
        if c.snapshot or c.events:
            yield from catchup_to_pb(log, c)
            stream_id, after = c.stream_id, c.last_seq
            continue
        log.wait(after, WAIT_S)


class KvEventsServicer:
    """Registered on the cache service's server (cache_service/server.py)."""

    def __init__(self, log: KVEventLog):
        self.log = log

    def Subscribe(self, request: pb.SubscribeRequest, context: object) -> Iterator[pb.KvEventBatch]:
        yield from stream(self.log, request, context.is_active)  # type: ignore[attr-defined]

    def GetRoutingInfo(self, request: pb.RoutingInfoRequest, context: object) -> pb.RoutingInfo:
        return pb.RoutingInfo(block_size=self.log.block_size)  # (the tokenizer: the gateway's)
