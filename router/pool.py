"""The replicas behind the router: who they are (--replicas, and --replicas-dns resolved each health
interval: every A/AAAA record of a headless Service), whether they are up (grpc.health.v1 on their
public port), their load (GetServerInfo), and one KV-event subscription each that keeps its index."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nanokv.protos import kv_events_pb2 as ev
from nanokv.protos import kv_events_pb2_grpc as ev_grpc
from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.protos import nanokv_v1_pb2_grpc as pb_grpc
from nanokv.router.replica import Replica, ReplicaAddress
from nanokv.tls import ClientTLS

log = logging.getLogger("nanokv.router")
READY_SERVICE = "nanokv.v1.Generation"  # a gateway says SERVING here when it can take requests
RESUBSCRIBE_S = 0.5
DEAD_AFTER_CHECKS = 3
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0),
                   ("grpc.enable_retries", 0)]


def resolve(name: str, port: int) -> list[str]:
    """Every address `name` resolves to (a headless Service answers one record per ready pod)."""
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except OSError as e:
        log.warning("cannot resolve %s: %s", name, e)
        return []
    return sorted({str(i[4][0]) for i in infos})


class ReplicaPool:
    def __init__(self, static: Sequence[ReplicaAddress], dns: tuple[str, int, int] | None, *,
                 health_interval_s: float, metadata: Sequence[tuple[str, str]] = (),
                 on_change: Callable[[], None] | None = None, tls: ClientTLS | None = None):
        self.static = list(static)
        self.tls = tls  # to the replicas' public ports (nanokv.tls); None: plaintext
        self.dns = dns
        self.interval = health_interval_s
        self.metadata = tuple(metadata)  # the router's own key, for its calls to the gateways
        self.on_change = on_change
        self.replicas: dict[str, Replica] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._loop_task: asyncio.Task[None] | None = None

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    async def start(self) -> None:
        await self.refresh()
        self._loop_task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        tasks = [t for t in (self._loop_task, *self._tasks.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for r in self.replicas.values():
            await r.channel.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # one bad round must not stop the checks
                log.exception("replica refresh failed")

    # ---- membership and health ---------------------------------------------------------------------
    def _wanted(self) -> list[ReplicaAddress]:
        out = list(self.static)
        if self.dns is not None:
            name, http_port, grpc_port = self.dns
            out += [ReplicaAddress(ip, http_port, grpc_port) for ip in resolve(name, grpc_port)]
        return list(dict.fromkeys(out))

    async def refresh(self) -> None:
        wanted = {a.name: a for a in self._wanted()}
        for name in [n for n in self.replicas if n not in wanted]:  # gone from DNS: forget it
            rep = self.replicas.pop(name)
            rep.mark(False)
            task = self._tasks.pop(name, None)
            if task is not None:
                task.cancel()
            await rep.channel.close()
            log.info("replica %s left", name)
        for name, addr in wanted.items():
            if name not in self.replicas:
                base = addr.http_url(self.tls is not None)
                self.replicas[name] = Replica(addr, self._channel(addr), http_base=base)
        await asyncio.gather(*(self._check(r) for r in list(self.replicas.values())))
        if self.on_change is not None:
            self.on_change()

    def _channel(self, addr: ReplicaAddress) -> grpc.aio.Channel:
        if self.tls is None:
            return grpc.aio.insecure_channel(addr.grpc_target, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(addr.grpc_target, self.tls.grpc_credentials(),
                                       options=CHANNEL_OPTIONS + self.tls.grpc_options())

    async def _check(self, rep: Replica) -> None:
        timeout = max(2.0, min(5.0, 2 * self.interval))  # a busy replica answers late, not never
        dead = False
        try:
            reply = await health_pb2_grpc.HealthStub(rep.channel).Check(
                health_pb2.HealthCheckRequest(service=READY_SERVICE), timeout=timeout)
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
            rep.last_error = "" if ok else "its health check says NOT_SERVING"
            if ok:
                info = await pb_grpc.GenerationStub(rep.channel).GetServerInfo(
                    pb.GetServerInfoRequest(), timeout=timeout, metadata=self.metadata)
                rep.num_running, rep.num_waiting = info.num_running, info.num_waiting
                # what other routers (or direct clients) have there: this router's own share is exact
                rep.others = max(0, info.num_running + info.num_waiting - rep.inflight)
                rep.kv_blocks_free, rep.kv_blocks_total = info.kv_blocks_free, info.kv_blocks_total
        except grpc.aio.AioRpcError as e:
            # refused (gone), or silent DEAD_AFTER_CHECKS checks in a row: down, and its streams end.
            # A late answer (a busy replica, whose event loop also serves its requests) changes nothing:
            # taking it out would send its conversations' next turns where their prefixes are not
            dead = e.code() == grpc.StatusCode.UNAVAILABLE or rep.failures + 1 >= DEAD_AFTER_CHECKS
            ok = rep.healthy and not dead
            error = f"{e.code().name}: {e.details()}"
            if not rep.last_error.startswith(error):  # a new reason (a replica refused from the start: once)
                if self.tls is not None and e.code() == grpc.StatusCode.UNAVAILABLE:
                    error += await self._tls_refusal(rep.address)
                log.warning("replica %s failed its check: %s", rep.name, error)
                rep.last_error = error
            elif rep.healthy:
                log.warning("replica %s failed its check: %s", rep.name, rep.last_error)
            if ok:
                rep.failures += 1
                return
        if ok != rep.healthy:
            log.info("replica %s is %s", rep.name, "up" if ok else "down")
        rep.mark(ok, dead)
        if ok and rep.name not in self._tasks:
            self._tasks[rep.name] = asyncio.create_task(self._follow(rep))

    async def _tls_refusal(self, addr: ReplicaAddress) -> str:
        """Why a TLS replica refuses: gRPC says only "Socket closed" when a replica turns down the router's
        certificate (or its lack of one), so one handshake and read of the router's own names the cause.
        An HTTP/2 server speaks first (its settings); one that closes instead, right after a handshake
        that went through, refused the client certificate. A failed handshake says why itself."""
        assert self.tls is not None
        ctx = self.tls.ssl_context()
        ctx.set_alpn_protocols(["h2"])
        writer = None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                addr.host, addr.grpc_port, ssl=ctx, server_hostname=self.tls.server_name or addr.host), 2.0)
            if await asyncio.wait_for(reader.read(1), 1.0) == b"":
                if self.tls.certfile is None:
                    return ("; TLS: the replica closed the connection after the handshake: it requires a client "
                            "certificate (--replica-ssl-certfile, --replica-ssl-keyfile)")
                return ("; TLS: the replica closed the connection after the handshake: it does not accept the "
                        "router's client certificate (signed by a CA it does not trust?)")
        except ssl.SSLError as e:
            return f"; TLS: {e.reason or e}"
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            if writer is not None:
                writer.close()
        return ""

    def report_failure(self, rep: Replica) -> None:
        """A request could not reach `rep`: its new requests go elsewhere now, not at the next check."""
        if rep.healthy:
            log.warning("replica %s unreachable: marked down until its next check", rep.name)
        rep.mark(False)
        if self.on_change is not None:
            self.on_change()

    # ---- the KV-event stream -------------------------------------------------------------------------
    async def _follow(self, rep: Replica) -> None:
        """Keep `rep`'s index: subscribe, apply, resubscribe from the last sequence number after a break
        (its gateway answers the rest, or a snapshot when the ring moved on or the cache restarted)."""
        try:
            while rep.name in self.replicas:
                req = ev.SubscribeRequest(stream_id=rep.stream_id, after_seq=rep.last_seq)
                try:
                    async for batch in ev_grpc.KvEventsStub(rep.channel).Subscribe(req, metadata=self.metadata):
                        rep.apply(batch)
                except grpc.aio.AioRpcError as e:
                    if rep.healthy and e.code() != grpc.StatusCode.CANCELLED:
                        log.info("KV events of %s broke (%s); resubscribing", rep.name, e.code().name)
                await asyncio.sleep(RESUBSCRIBE_S)
        finally:
            self._tasks.pop(rep.name, None)
