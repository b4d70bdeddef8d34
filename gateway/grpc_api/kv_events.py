"""nanokv.events.v1.KvEvents on the gateway's public server: a router subscribes here, never to the
cache service (whose port stays inside the pod). Services in this process: read the cache service's
event log; in another process: forward its Subscribe stream message by message. GetRoutingInfo
answers the block size and the tokenizer's files, so a router needs no model files."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from nanokv.cache_service.kv_events_rpc import BATCH_EVENTS, catchup_to_pb
from nanokv.protos import kv_events_pb2 as pb
from nanokv.protos import kv_events_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from nanokv.gateway.engine import Engine

POLL_S = 0.02  # an in-process log is polled (its wait() would hold a thread of the event loop's pool)


class KvEventsRelay:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._info: pb.RoutingInfo | None = None

    async def Subscribe(self, req: pb.SubscribeRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[pb.KvEventBatch]:
        local = self.engine.local_cache
        if local is None:
            async for batch in self._forward(req):
                yield batch
            return
        log, stream_id, after = local.events, req.stream_id, req.after_seq
        while True:
            c = log.read(after, stream_id, BATCH_EVENTS)
            if not (c.snapshot or c.events):
                await asyncio.sleep(POLL_S)
                continue
            for batch in catchup_to_pb(log, c):
                yield batch
            stream_id, after = c.stream_id, c.last_seq

    async def _forward(self, req: pb.SubscribeRequest) -> AsyncIterator[pb.KvEventBatch]:
        address = self.engine.config.gateway.cache_address or ""
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.KvEventsStub(channel)  # type: ignore[no-untyped-call]  # (generated, untyped)
            async for batch in stub.Subscribe(req):
                yield batch

    async def GetRoutingInfo(self, req: pb.RoutingInfoRequest, context: grpc.aio.ServicerContext) -> pb.RoutingInfo:
        if self._info is None:
            files = await asyncio.to_thread(_tokenizer_files, self.engine.tokenizer)
            self._info = pb.RoutingInfo(block_size=self.engine.config.block_size, tokenizer_files=files,
                                        model=self.engine.model_name)
        return self._info


def _tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    """The files save_pretrained writes ({} without a tokenizer: token-id prompts only)."""
    if tokenizer is None:
        return {}
    with tempfile.TemporaryDirectory(prefix="nanokv-tokenizer-") as d:
        tokenizer.save_pretrained(d)
        out = {}
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), "rb") as f:
                out[name] = f.read()
        return out
