"""nanokv.v1.Generation: streaming generation, abort, model and server info.

Each Generate call owns one engine request. However the call ends (last token, client cancel,
deadline, Abort, an error) its `finally` releases the request, which aborts it on the engine thread
so its KV blocks go back to the pool at once. Request ids are scoped by caller (API key): one
tenant can neither see nor abort another's requests.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from nanokv import __version__
from nanokv.errors import RequestError
from nanokv.gateway.grpc_api import validate
from nanokv.gateway.grpc_api.auth import KeyRing
from nanokv.gateway.grpc_api.errors import DuplicateRequest
from nanokv.gateway.http.async_engine import AsyncEngine, RequestStream, Update
from nanokv.protos import nanokv_v1_pb2 as pb

if TYPE_CHECKING:
    from nanokv.gateway.engine import Engine
    from nanokv.gateway.outputs import RequestOutput


@dataclass(frozen=True)
class PublicModelInfo:
    """What GetModelInfo and the KServe metadata report; read from the engine before its thread starts."""
    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int

    @classmethod
    def from_engine(cls, engine: Engine, name: str) -> PublicModelInfo:
        mi = engine.model_info
        return cls(name=name, max_model_len=int(engine.max_model_len), vocab_size=int(mi.vocab_size),
                   eos_token_ids=tuple(sorted(int(t) for t in engine.eos_token_ids)), block_size=int(mi.block_size))


class ClientAbort(Exception):
    """Put into a request's stream by Abort: the Generate call ends with finish_reason 'abort'."""


def cache_salt(tenant: str | None, client_salt: str) -> str | None:
    """The same namespaces as the HTTP API, so a tenant's gRPC and HTTP requests share its cache."""
    parts = ([f"tenant={tenant}"] if tenant else []) + ([f"salt={client_salt}"] if client_salt else [])
    return "|".join(parts) or None


def _logprobs(u: Update) -> list[pb.TokenLogprob]:
    out = u.output
    if not out.logprobs or not out.new_token_ids:
        return []
    text = u.token_text
    return [pb.TokenLogprob(token_id=e["token_id"], logprob=e["logprob"], text=text.get(e["token_id"], ""),
                            top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp, text=text.get(t, ""))
                                          for t, lp in e["top"].items()])
            for e in out.logprobs[-len(out.new_token_ids):]]


def usage(out: RequestOutput) -> pb.Usage:
    return pb.Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(out.token_ids),
                    cached_prompt_tokens=out.num_cached_tokens,
                    cached_prompt_tokens_by_tier=out.cached_tokens_by_tier or {})


class GenerationServicer:
    def __init__(self, aengine: AsyncEngine, info: PublicModelInfo, keys: KeyRing):
        self.aengine = aengine
        self.info = info
        self.keys = keys
        self.live: dict[tuple[str | None, str], RequestStream | None] = {}  # (tenant, client id) -> stream

    async def start(self, req: pb.GenerateRequest, tenant: str | None, track: bool = True
                    ) -> tuple[str, RequestStream]:
        """Check the request and queue it; returns (client request id, stream). The caller must
        `finish(tenant, rid, stream)` whatever happens next. `track`: Abort can find it by id."""
        validate.check_model(req.model, self.info.name)
        validate.check_request_id(req.request_id)
        validate.check_cache_salt(req.cache_salt)
        prompt = validate.prompt_of(req)
        params = validate.sampling_params(req.sampling_params, self.info.max_model_len)
        rid = req.request_id or f"gen-{uuid.uuid4().hex}"
        key = (tenant, rid)
        if not track:
            key = (tenant, f"untracked-{uuid.uuid4().hex}")
        elif key in self.live:
            raise DuplicateRequest(f"request_id: '{rid}' is already running; allowed: an id not in use")
        self.live[key] = None  # reserved while the engine admits it
        try:
            # engine-side ids are fresh: client ids are per tenant and may repeat across tenants
            stream = await self.aengine.generate(f"grpc-{uuid.uuid4().hex}", params, prompt=prompt,
                                                 cache_salt=cache_salt(tenant, req.cache_salt))
        except RequestError as e:
            self.live.pop(key, None)
            raise RequestError(validate.prompt_field(req, e.field), e.message) from None
        except BaseException:
            self.live.pop(key, None)
            raise
        if track:
            self.live[key] = stream
        else:
            del self.live[key]
        return rid, stream

    def finish(self, tenant: str | None, rid: str, stream: RequestStream) -> None:
        if self.live.get((tenant, rid)) is stream:
            del self.live[(tenant, rid)]
        self.aengine.release(stream)

    async def Generate(self, req: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        tenant = self.keys.tenant(context.invocation_metadata())
        rid, stream = await self.start(req, tenant)
        last = None
        try:
            try:
                async for u in stream:
                    last = out = u.output
                    chunk = pb.GenerateResponse(request_id=rid, token_ids=out.new_token_ids, text=out.delta_text,
                                                logprobs=_logprobs(u), finished=out.finished)
                    if out.finished:
                        chunk.finish_reason = out.finish_reason or ""
                        chunk.stop_reason = "" if out.stop_reason is None else str(out.stop_reason)
                        chunk.usage.CopyFrom(usage(out))
                    yield chunk
            except ClientAbort:
                end = pb.GenerateResponse(request_id=rid, finished=True, finish_reason="abort")
                if last is not None:
                    end.usage.CopyFrom(usage(last))
                yield end
        finally:
            self.finish(tenant, rid, stream)

    async def Abort(self, req: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        validate.check_request_id(req.request_id)
        if not req.request_id:
            raise RequestError("request_id", "required; allowed: the id of one of your running Generate calls")
        key = (self.keys.tenant(context.invocation_metadata()), req.request_id)
        stream = self.live.get(key)
        if stream is None or stream.finished:
            return pb.AbortResponse(aborted=False)
        del self.live[key]
        self.aengine.release(stream)  # blocks freed now, not when the Generate call notices
        stream._queue.put_nowait(ClientAbort())  # wakes that call: it sends its 'abort' chunk and ends
        return pb.AbortResponse(aborted=True)

    async def GetModelInfo(self, req: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        i = self.info
        return pb.ModelInfo(name=i.name, max_model_len=i.max_model_len, vocab_size=i.vocab_size,
                            eos_token_ids=list(i.eos_token_ids), block_size=i.block_size)

    async def GetServerInfo(self, req: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
                            ) -> pb.ServerInfo:
        # not engine.stats(): that drains the batch-size samples /metrics reads
        cs, running, waiting = await self.aengine.call(
            lambda e: (e.cache.stats(), e.num_running(), e.num_waiting()))
        return pb.ServerInfo(version=__version__, num_running=running, num_waiting=waiting,
                             max_waiting=self.aengine.max_waiting, kv_blocks_total=cs["kv_blocks_total"],
                             kv_blocks_free=cs["kv_blocks_free"], kv_cache_usage=cs["kv_cache_usage"],
                             ready=self.aengine.ready)
