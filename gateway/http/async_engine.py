"""One Engine, driven by one background thread; asyncio handlers talk to it through queues.

Engine methods are not thread-safe, so *every* engine call (tokenising, add, abort, step, stats)
happens on the engine thread. Handlers send commands through a thread-safe queue and receive
outputs on per-request asyncio queues, filled via `loop.call_soon_threadsafe`. A handler that goes
away (client disconnect, cancellation) calls `release`, which aborts the request so its KV blocks
return to the pool at once.

Admission is decided on the engine thread too, where the waiting count is exact: a request the
engine rejects (can never fit, bad prompt) gets its error first; a valid one that would push the
waiting queue past `max_waiting` is withdrawn and answered with QueueFull (HTTP 429).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from nanokv import tracing
from nanokv.errors import RequestError
from nanokv.gateway.http.streams import EngineUnavailable, QueueFull, RequestStream, Update
from nanokv.gateway.outputs import RequestOutput
from nanokv.gateway.recovery import PEER_ERRORS
from nanokv.gateway.sequence import TokenLogprob
from nanokv.sampling import SamplingParams

if TYPE_CHECKING:
    from nanokv.gateway.engine import Engine
    from nanokv.gateway.metrics import EngineMetrics
    from nanokv.gateway.recovery import Recovery

__all__ = ["AsyncEngine", "EngineUnavailable", "QueueFull", "RequestStream", "Update"]

log = logging.getLogger("nanokv.gateway.http")
T = TypeVar("T")


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None  # chat messages as the client sent them (JSON objects)
    params: SamplingParams
    cache_salt: str | None
    done: concurrent.futures.Future[None]
    trace: object = None  # the handler's trace context: the request span's parent (nanokv.gateway.traces)


@dataclass
class _Call:
    fn: Callable[[Engine], object]
    done: concurrent.futures.Future[Any]  # (of fn's result type)


_STOP = object()


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: EngineMetrics | None = None, *, max_waiting: int = 256,
                 stats_interval_s: float = 0.25):
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.stats_interval_s = stats_interval_s
        # _Add, _Call, ("abort", request_id) or _STOP
        self._commands: queue.SimpleQueue[_Add | _Call | tuple[str, str] | object] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._active: dict[str, bool] = {}  # engine thread only: request id -> wants token texts
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # ---- lifecycle (loop thread) ------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="nanokv-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_STOP)
            await asyncio.to_thread(self._thread.join, 30)

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def ready(self) -> bool:
        """Healthy and attached to its services (false while one is down: nanokv.gateway.recovery)."""
        return self.healthy and self.engine.ready

    @property
    def not_ready_reason(self) -> str:
        recovery = self.engine.recovery
        return recovery.reason if recovery is not None and not recovery.ready else "engine not running"

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests (loop thread) -------------------------------------------------------------
    async def generate(self, request_id: str, params: SamplingParams, *,
                       prompt: str | list[int] | None = None, messages: list[dict[str, Any]] | None = None,
                       cache_salt: str | None = None) -> RequestStream:
        """Queue a request; raises RequestError (bad input), QueueFull or EngineUnavailable."""
        if not self.healthy:
            raise EngineUnavailable("the engine is not running")
        if not self.ready:
            raise EngineUnavailable(f"a service is unavailable ({self.not_ready_reason}); retry later")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream  # before the add, so no output can arrive unrouted
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(_Add(request_id, prompt, messages, params, cache_salt, done, tracing.capture()))
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            # Rejected, or the client left while we waited: make sure nothing stays queued.
            self.release(stream)
            raise
        return stream

    def release(self, stream: RequestStream) -> None:
        """Abort the request unless it already finished; idempotent."""
        if self._streams.pop(stream.request_id, None) is not None and not stream.finished:
            self._commands.put(("abort", stream.request_id))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the engine thread (debug/test hook; e.g. read block counts)."""
        return await asyncio.wrap_future(self.submit_call(fn))

    def submit_call(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """Thread-safe variant of `call` for code outside the event loop: `.result(timeout)`."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not (self._thread is not None and self._thread.is_alive()):
            done.set_exception(EngineUnavailable("the engine thread is not running"))
        else:
            self._commands.put(_Call(fn, done))
        return done

    async def refresh_stats(self, timeout_s: float = 1.0) -> None:
        """Publish a fresh stats snapshot (a scrape then sees the engine as it is now, not up to
        `stats_interval_s` ago). Gives up after timeout_s, e.g. behind a long prefill step."""
        if not self.healthy:
            return
        try:
            await asyncio.wait_for(self.call(lambda _: self._publish_stats()), timeout_s)
        except (asyncio.TimeoutError, EngineUnavailable):
            pass

    def _route(self, updates: list[Update]) -> None:  # loop thread
        for u in updates:
            stream = self._streams.get(u.output.request_id)
            if stream is None:
                continue  # released by its handler meanwhile
            if u.output.finished:
                del self._streams[u.output.request_id]
            stream._queue.put_nowait(u)

    def _fail_all(self, exc: BaseException) -> None:  # loop thread
        streams, self._streams = self._streams, {}
        for s in streams.values():
            s._queue.put_nowait(exc)

    def _to_loop(self, fn: Callable[..., None], *args: object) -> None:
        try:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # loop already closed during shutdown: nobody is listening any more

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        next_stats = 0.0
        try:
            while True:
                try:
                    if not self._drain(block=not self.engine.has_unfinished_requests()):
                        break
                    if (recovery := self.engine.recovery) is not None and not recovery.ready:
                        recovery.try_attach()  # a service is down: retry, serve nothing
                        continue
                    if self.engine.has_unfinished_requests():
                        outputs = self.engine.step()
                        if outputs:
                            self._deliver(outputs)
                    else:
                        self.engine.tick_idle()  # the controller's windows go on while idle (pool shrink)
                    now = time.monotonic()
                    if now >= next_stats:
                        next_stats = now + self.stats_interval_s
                        self._publish_stats()
                except PEER_ERRORS as exc:
                    if self.engine.recovery is None:
                        raise
                    self._outage(self.engine.recovery, exc)
            reason: BaseException = EngineUnavailable("the server is shutting down")
        except Exception as exc:  # an engine bug: fail loudly, free what we can, report unhealthy
            log.exception("engine step failed; the engine thread stops")
            self.error = reason = exc
        self._abort_everything()
        self._to_loop(self._fail_all, EngineUnavailable(f"engine stopped: {reason}"))
        self._fail_pending_commands()

    def _outage(self, recovery: Recovery, exc: BaseException) -> None:
        """A service failed: every request in flight ends with EngineUnavailable (HTTP 503, gRPC
        UNAVAILABLE) now, not after a client timeout; the thread lives on and re-attaches."""
        recovery.on_failure(exc)
        self._active.clear()
        self._to_loop(self._fail_all, EngineUnavailable(f"a service failed mid-request: {exc}"))

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; returns False on stop. Blocks briefly when there is no work."""
        try:
            cmd = self._commands.get(timeout=self.stats_interval_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is _STOP:
                return False
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: object) -> None:
        if isinstance(cmd, _Add):
            self._add(cmd)
        elif isinstance(cmd, _Call):
            if cmd.done.set_running_or_notify_cancel():
                try:
                    cmd.done.set_result(cmd.fn(self.engine))
                except Exception as exc:
                    cmd.done.set_exception(exc)
        elif isinstance(cmd, tuple) and self._active.pop(cmd[1], None) is not None:  # ("abort", request_id)
            self.engine.abort(cmd[1])
            if self.metrics is not None:
                self.metrics.observe_abort()

    def _add(self, cmd: _Add) -> None:
        if not cmd.done.set_running_or_notify_cancel():
            return  # the client left before we got here
        try:
            prompt = self.engine.apply_chat_template(cmd.messages) if cmd.messages is not None else cmd.prompt
            if prompt is None:
                raise RequestError("prompt", "must be a non-empty string or a non-empty list of token ids")
            with tracing.attached(cmd.trace):
                self.engine.add_request(cmd.request_id, prompt, cmd.params, cache_salt=cmd.cache_salt)
            if self.engine.num_waiting() > self.max_waiting:
                self.engine.abort(cmd.request_id)
                raise QueueFull(f"{self.max_waiting} requests are already waiting")
        except Exception as exc:  # RequestError, QueueFull, or a tokenizer failure
            cmd.done.set_exception(exc)
            return
        self._active[cmd.request_id] = cmd.params.logprobs is not None
        cmd.done.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        updates = []
        for out in outputs:
            text: dict[int, str] = {}
            if self._active.get(out.request_id) and out.logprobs and out.new_token_ids:
                text = self._token_text(out.logprobs[-len(out.new_token_ids):])
            if out.finished:
                self._active.pop(out.request_id, None)
                if self.metrics is not None:
                    self.metrics.observe_finished(out)
            updates.append(Update(out, text))
        self._to_loop(self._route, updates)

    def _token_text(self, entries: list[TokenLogprob]) -> dict[int, str]:
        ids = {e["token_id"] for e in entries} | {t for e in entries for t in e["top"]}
        tok = self.engine.tokenizer
        if tok is None:  # random-weight test models have no tokenizer: show the ids
            return {i: str(i) for i in ids}
        return {i: tok.decode([i]) for i in ids}

    def _publish_stats(self) -> None:
        if self.metrics is not None:
            self.metrics.update(self.engine.stats())

    def _abort_everything(self) -> None:
        try:
            for rid in list(self._active):
                self.engine.abort(rid)
            self._active.clear()
        except Exception:
            log.exception("could not abort in-flight requests")

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, (_Add, _Call)) and not cmd.done.done():
                cmd.done.set_exception(EngineUnavailable("the engine thread stopped"))
