"""The shared lowest tier's I/O: KV blocks in a Valkey (or Redis) server that several replicas share
(``remote_cache_url=redis://[:password@]host:port/db``, ``rediss://`` for TLS). Pure Python: a
payload is opaque bytes; deciding which blocks go there is the hierarchy's business.

Keys are bytes: ``<namespace>:<fingerprint>:`` + the 32-byte salted chained block hash
(cache_service/hashing.py). The fingerprint names the model and KV format, so two models (or one
model in two KV formats) sharing a server never read each other's blocks, and the salt keeps one
tenant's blocks from another's. Values are framed as the disk tier's files are (disk_format.py: a
184-byte header with fingerprint, length and checksums, then the payload); a value that fails the
check (corrupt, truncated, written by another model) is deleted, counted and reported as a miss,
never returned. Every write sets a TTL and every hit renews it, so the server forgets cold blocks
by itself (run it with ``maxmemory-policy allkeys-lru`` too, so a full server evicts, not refuses).

A down, slow or misconfigured store never raises out of get/put/exists: the call returns a miss /
not-stored within ``timeout_s`` and is counted; the store is then skipped (calls return at once)
for ``retry_after_s`` before one call tries it again. One warning is logged per change of state
(up -> unreachable, unreachable -> auth_failed, ...), never one per call.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from nanokv.cache_service.tiers.disk_format import (
    HASH_BYTES,
    HEADER_SIZE,
    BadFile,
    check_payload,
    fingerprint_digest,
    pack_header,
    parse_header,
)
from nanokv.errors import ConfigError, NanoKVError

log = logging.getLogger("nanokv.cache_service.remote")

T = TypeVar("T")
SCHEMES = ("redis", "rediss")
TLS_QUERY = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")  # rediss:// only
DROP_KINDS = ("corrupt", "foreign", "truncated")
WARN_EVERY_S = 60.0  # at most one warning a minute per kind of dropped value
STATES = ("up", "unreachable", "timeout", "auth_failed", "tls_failed", "error")
COUNTERS = ("gets", "hits", "misses", "puts", "stored", "not_stored", "exists", "skipped", "bytes_written",
            "bytes_read") + tuple(f"{s}_errors" for s in STATES[1:]) + tuple(f"{k}_dropped" for k in DROP_KINDS)


def redacted(url: str) -> str:
    """The URL with its password replaced, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def check_url(url: object, field: str = "remote_cache_url") -> str:
    """A clear ConfigError for anything but redis://[[user]:password@]host[:port][/db] or rediss://."""
    if not isinstance(url, str) or not url:
        raise ConfigError(field, f"must be a URL redis://[:password@]host:port/db or rediss://..., got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ConfigError(field, f"scheme must be one of {', '.join(SCHEMES)} (rediss = TLS), got {parts.scheme!r}")
    if not parts.hostname:
        raise ConfigError(field, f"names no host: {redacted(url)}")
    try:
        parts.port  # noqa: B018 - raises ValueError when out of range
    except ValueError:
        raise ConfigError(field, f"port must be 1..65535: {redacted(url)}") from None
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ConfigError(field, f"the path must be a database number (/0), got /{db}")
    allowed = TLS_QUERY if parts.scheme == "rediss" else ()
    for key in parse_qs(parts.query):
        if key not in allowed:
            raise ConfigError(field, f"unknown option {key!r}; allowed: {', '.join(allowed) or 'none'} "
                                     f"({', '.join(TLS_QUERY)} need rediss://)")
    return url


def _check_hash(field: str, value: object) -> bytes:
    if not isinstance(value, bytes) or len(value) != HASH_BYTES:
        got = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise NanoKVError(field, f"must be a {HASH_BYTES}-byte block hash (cache_service/hashing.py), got {got}")
    return value


def _state_of(exc: Exception) -> str:
    if isinstance(exc, redis.AuthenticationError) or (
            isinstance(exc, redis.ResponseError) and str(exc).startswith(("NOAUTH", "WRONGPASS", "NOPERM"))):
        return "auth_failed"
    if isinstance(exc, ssl.SSLError) or isinstance(exc.__cause__ or exc.__context__, ssl.SSLError) \
            or "[SSL" in str(exc):  # an untrusted certificate, or no TLS on one side
        return "tls_failed"
    if isinstance(exc, redis.TimeoutError):
        return "timeout"
    if isinstance(exc, redis.ConnectionError | OSError):
        return "unreachable"
    return "error"


class RemoteStore:
    """Thread-safe. ``status`` is "up" or why the store is being skipped; ``counters()`` are the
    ``remote_tier_*_total`` metrics, ``available`` the ``remote_tier_available`` gauge."""

    def __init__(self, url: str, fingerprint: bytes | str, *, namespace: str = "nanokv", ttl_s: int = 3600,
                 timeout_s: float = 0.5, retry_after_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        check_url(url)
        if not fingerprint:
            raise ConfigError("fingerprint", "must name the model and KV format (non-empty bytes or str)")
        if not namespace or ":" in namespace:
            raise ConfigError("namespace", f"must be a non-empty name without ':', got {namespace!r}")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 1:
            raise ConfigError("ttl_s", f"must be an integer >= 1 second, got {ttl_s!r}")
        for name, value in (("timeout_s", timeout_s), ("retry_after_s", retry_after_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(name, f"must be > 0 seconds, got {value!r}")
        self.url, self.ttl_s, self.retry_after_s, self._clock = redacted(url), ttl_s, retry_after_s, clock
        self._fp = fingerprint_digest(fingerprint)
        self._prefix = f"{namespace}:{self._fp[:16].hex()}:".encode()
        # no client-side retries: one attempt bounded by timeout_s, then the store's own back-off
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._lock = threading.Lock()
        self._count: Counter[str] = Counter()
        self.status, self.detail = "up", ""
        self._skip_until = 0.0  # monotonic time before which calls skip the store
        self._warned: dict[str, float] = {}

    # ---- the three operations ---------------------------------------------------------------------
    def get(self, block_hash: bytes) -> bytes | None:
        """The verified payload, or None: a miss, a bad value (deleted and counted), or the store
        down / slow / refusing (counted; skipped for a while)."""
        key = self.key(_check_hash("block_hash", block_hash))
        self._add("gets")
        raw = self._call(lambda c: c.getex(key, ex=self.ttl_s))
        payload = None if raw is None else self._verified(key, block_hash, raw)
        self._add("hits" if payload is not None else "misses")
        return payload

    def get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """``get`` of each, in one round trip (a pipeline): a prefix's blocks load together."""
        keys = [self.key(_check_hash("block_hash", h)) for h in block_hashes]
        self._add("gets", len(keys))

        def run(c: redis.Redis) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for k in keys:
                pipe.getex(k, ex=self.ttl_s)
            return list(pipe.execute())
        raws = self._call(run) if keys else []
        out = [None if raw is None else self._verified(k, h, raw)
               for k, h, raw in zip(keys, block_hashes, raws or [None] * len(keys))]
        hits = sum(p is not None for p in out)
        self._add("hits", hits)
        self._add("misses", len(out) - hits)
        return out

    def put(self, block_hash: bytes, payload: object, parent_hash: bytes | None = None) -> bool:
        """Store a block under its hash with the TTL; True once the server has it, False (never an
        exception) when the store is down, slow, refusing or full."""
        key = self.key(_check_hash("block_hash", block_hash))
        if parent_hash is not None:
            _check_hash("parent_hash", parent_hash)
        view = memoryview(payload)  # type: ignore[arg-type]  # any buffer-protocol object
        if view.ndim != 1 or view.format not in ("B", "b", "c"):
            view = view.cast("B")
        value = pack_header(self._fp, block_hash, parent_hash, view) + view.tobytes()
        self._add("puts")
        ok = bool(self._call(lambda c: c.set(key, value, ex=self.ttl_s)))
        self._add("stored" if ok else "not_stored")
        if ok:
            self._add("bytes_written", len(value))
        return ok

    def exists(self, block_hash: bytes) -> bool:
        """Whether the server holds the block (a get may still miss if its value turns out bad)."""
        key = self.key(_check_hash("block_hash", block_hash))
        self._add("exists")
        return bool(self._call(lambda c: c.exists(key)))

    __contains__ = exists

    def key(self, block_hash: bytes) -> bytes:
        return self._prefix + block_hash

    # ---- health -----------------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self.status == "up"

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {f"remote_tier_{k}_total": self._count[k] for k in COUNTERS}

    def close(self) -> None:
        self._client.close()

    def _add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._count[name] += n

    def _call(self, fn: Callable[[redis.Redis], T]) -> T | None:
        """fn(client), or None when the store is skipped or the call fails. While the store is down,
        only the one call that finds the back-off over tries it; the others skip at once."""
        with self._lock:
            now = self._clock()
            if now < self._skip_until:
                self._count["skipped"] += 1
                return None
            if self.status != "up":
                self._skip_until = now + self.retry_after_s  # this call probes; the rest keep skipping
        try:
            result = fn(self._client)
        except (redis.RedisError, OSError) as exc:
            self._set_state(_state_of(exc), f"{type(exc).__name__}: {exc}")
            return None
        if self.status != "up":
            self._set_state("up", "")
        return result

    def _set_state(self, state: str, detail: str) -> None:
        with self._lock:
            was, self.status, self.detail = self.status, state, detail
            if state == "up":
                self._skip_until = 0.0  # the probing call's own hold
            else:
                self._count[f"{state}_errors"] += 1
                self._skip_until = self._clock() + self.retry_after_s
        if state == was:
            return
        if state == "up":
            log.warning("shared KV tier %s is back (was %s); metric remote_tier_available=1", self.url, was)
        else:
            log.warning("shared KV tier %s: %s (%s); skipping it for %g s, then retrying; requests are "
                        "unaffected; metrics remote_tier_available=0, remote_tier_%s_errors_total",
                        self.url, state, detail, self.retry_after_s, state)

    def _verified(self, key: bytes, block_hash: bytes, raw: object) -> bytes | None:
        try:
            if not isinstance(raw, bytes):  # the client decodes nothing (decode_responses off)
                raise BadFile("corrupt", f"a {type(raw).__name__} value, not bytes")
            header = parse_header(raw[:HEADER_SIZE], self._fp, len(raw), expect_hash=block_hash)
            payload = raw[HEADER_SIZE:]
            check_payload(header, payload)
        except BadFile as bad:
            self._add(f"{bad.kind}_dropped")
            now = self._clock()
            if now - self._warned.get(bad.kind, -WARN_EVERY_S) >= WARN_EVERY_S:
                self._warned[bad.kind] = now
                log.warning("shared KV tier %s dropped the value of %s (%s: %s); metric remote_tier_%s_dropped_total",
                            self.url, block_hash.hex()[:16], bad.kind, bad.detail, bad.kind)
            self._call(lambda c: c.delete(key))
            return None
        self._add("bytes_read", len(raw))
        return payload
