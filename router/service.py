"""The router's state, shared by its HTTP and gRPC fronts: the replica pool, the routing policy, the
prompt reader and the metrics. Nothing here outlives the process but what the event streams rebuild,
so several routers can run side by side."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TypeVar

import grpc

from nanokv.gateway.http.middleware import tenant_id
from nanokv.protos import kv_events_pb2 as ev
from nanokv.protos import kv_events_pb2_grpc as ev_grpc
from nanokv.router.metrics import RouterMetrics
from nanokv.router.pool import ReplicaPool
from nanokv.router.prompts import PromptReader
from nanokv.router.replica import Replica, ReplicaAddress
from nanokv.router.routing import Choice, Router, salt_of
from nanokv.tls import ClientTLS

log = logging.getLogger("nanokv.router")
T = TypeVar("T")


class NoReplica(Exception):
    """No healthy replica (HTTP 503, gRPC UNAVAILABLE)."""


class RouterService:
    def __init__(self, replicas: Sequence[ReplicaAddress], dns: tuple[str, int, int] | None, *,
                 policy: str = "kv", api_keys: Sequence[str] = (), health_interval_s: float = 2.0,
                 load_weight: float = 0.25, tls: ClientTLS | None = None):
        self.api_keys = list(api_keys)
        # the router's calls of its own (events, load, the tokenizer) carry its first key
        metadata = [("authorization", f"Bearer {self.api_keys[0]}")] if self.api_keys else []
        self.pool = ReplicaPool(replicas, dns, health_interval_s=health_interval_s, metadata=metadata,
                                on_change=self._changed, tls=tls)
        self.router = Router(policy, load_weight)
        self.prompts = PromptReader()
        self.metrics = RouterMetrics(lambda: list(self.pool.replicas.values()))
        self.on_health: list[Callable[[bool], None]] = []  # the gRPC front's readiness
        self._tokenizer_lock = asyncio.Lock()

    async def start(self) -> None:
        await self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()

    def _changed(self) -> None:
        n = len(self.pool.healthy())
        self.metrics.healthy.set(n)
        for f in self.on_health:
            f(n > 0)

    def tenant(self, presented_key: str | None) -> str | None:
        """The tenant the replica's gateway will see: the gateways hold the same keys as the router."""
        if not self.api_keys or presented_key is None or presented_key not in self.api_keys:
            return None
        return tenant_id(presented_key)

    async def ensure_tokenizer(self) -> None:
        if self.prompts.loaded:
            return
        async with self._tokenizer_lock:
            for rep in self.pool.healthy():
                if self.prompts.loaded:
                    return
                try:
                    info = await ev_grpc.KvEventsStub(rep.channel).GetRoutingInfo(
                        ev.RoutingInfoRequest(), timeout=60, metadata=self.pool.metadata)
                    await asyncio.to_thread(self.prompts.load, info)
                except (grpc.aio.AioRpcError, ValueError, OSError) as e:
                    log.warning("no tokenizer from %s: %s", rep.name, e)

    def choose(self, api: str, token_ids: Sequence[int] | None, tenant: str | None, client_salt: str | None
               ) -> Choice:
        healthy = self.pool.healthy()
        if not healthy:
            self.metrics.no_replica.inc()
            raise NoReplica(self.no_replica_reason())
        choice = self.router.choose(healthy, token_ids, salt_of(tenant, client_salt))
        first = choice.order[0]
        self.metrics.routed_to(first.name, api, choice.prompt_tokens, choice.predicted_hit_tokens)
        return choice

    def no_replica_reason(self) -> str:
        """What a caller is told when nothing can take a request: the replicas' last check errors (a
        refused TLS handshake reads as such, not as a bare 503)."""
        why = "; ".join(f"{r.name}: {r.last_error}" for r in self.pool.replicas.values() if r.last_error)
        return "no healthy replica behind this router" + (f" (last checks: {why})" if why else "")

    def failed(self, rep: Replica) -> None:
        self.metrics.failed.labels(rep.name).inc()
        self.pool.report_failure(rep)

    @contextlib.contextmanager
    def holding(self, rep: Replica) -> Iterator[None]:
        """While a request runs on `rep`: counted in its load (the router's own view, between checks)."""
        rep.inflight += 1
        try:
            yield
        finally:
            rep.inflight -= 1


class ReplicaDown(Exception):
    """The replica a stream runs on was marked down (a check or another request found it dead)."""


async def until_down(items: AsyncIterator[T], rep: Replica) -> AsyncIterator[T]:
    """`items`, but ended by ReplicaDown as soon as `rep` is marked down: a stream on a replica that
    went silent (a dead host sends no reset) ends within a health interval instead of hanging."""
    down = asyncio.ensure_future(rep.down.wait())
    it = items.__aiter__()
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            await asyncio.wait((nxt, down), return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                raise ReplicaDown(f"replica {rep.name} went down")
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        down.cancel()
