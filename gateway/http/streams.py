"""What a request handler holds while its request runs: a stream of updates, and the two ways
admission can fail before it starts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from nanokv.errors import ServiceUnavailable
from nanokv.gateway.outputs import RequestOutput


class QueueFull(Exception):
    """The waiting queue is at its bound; the client should retry later."""


class EngineUnavailable(ServiceUnavailable):
    """The engine thread stopped (shutdown or an engine failure), or a service it needs is down
    (HTTP 503; the gRPC API's UNAVAILABLE)."""


@dataclass
class Update:
    output: RequestOutput
    token_text: dict[int, str] = field(default_factory=dict)  # text of token ids in new logprob entries


class RequestStream:
    """Async iterator over one request's updates; ends after the finished one."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.finished = False
        self._queue: asyncio.Queue[Update | BaseException] = asyncio.Queue()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Update:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.output.finished
        return item
