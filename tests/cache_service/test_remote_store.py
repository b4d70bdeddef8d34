"""The shared tier's store client (cache_service/tiers/remote_store.py) against a real Valkey/Redis
server process (tests/helpers_valkey.py): round trips, TTLs, passwords, TLS, bad values, and a server
that dies, stalls and comes back, which must never raise out of the client nor hold a caller up."""

from __future__ import annotations

import hashlib
import logging
import os
import time

import pytest
import redis

from nanokv.cache_service.tiers.disk_format import HEADER_SIZE
from nanokv.cache_service.tiers.remote_store import RemoteStore, check_url, redacted
from nanokv.errors import ConfigError, NanoKVError
from tests.helpers_valkey import Server, make_certs, require_server, tls_supported

FP = "SmolLM2-135M|bf16|block16"  # the model + KV-format fingerprint the cache service passes


def h(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def payload(i: int, n: int = 4096) -> bytes:
    return (hashlib.sha256(f"kv {i}".encode()).digest() * (n // 32 + 1))[:n]


@pytest.fixture
def server(tmp_path):
    servers: list[Server] = []

    def make(**kw) -> Server:
        s = Server(require_server(), tmp_path / f"valkey{len(servers)}", **kw).start()
        servers.append(s)
        return s
    yield make
    for s in servers:
        s.stop()


def store(url: str, **kw) -> RemoteStore:
    kw.setdefault("timeout_s", 0.3)
    kw.setdefault("retry_after_s", 0.5)
    return RemoteStore(url, kw.pop("fingerprint", FP), **kw)


def test_round_trip_and_isolation(server):
    srv = server()
    st = store(srv.url)
    assert st.get(h(1)) is None and not st.exists(h(1))
    assert st.put(h(1), payload(1), parent_hash=h(0))
    assert st.put(h(2), memoryview(bytearray(payload(2))))  # any buffer
    assert st.exists(h(1)) and h(2) in st
    assert st.get(h(1)) == payload(1) and st.get(h(2)) == payload(2)
    assert st.get_many([h(1), h(3), h(2)]) == [payload(1), None, payload(2)]
    c = st.counters()
    assert c["remote_tier_hits_total"] == 4 and c["remote_tier_misses_total"] == 2
    assert c["remote_tier_stored_total"] == 2 and c["remote_tier_bytes_written_total"] == 2 * (HEADER_SIZE + 4096)
    # the key: namespace + fingerprint + the raw block hash, so another model never reads these blocks
    raw = redis.Redis.from_url(srv.url)
    assert raw.exists(st.key(h(1))) and st.key(h(1)).startswith(b"nanokv:") and st.key(h(1)).endswith(h(1))
    other = store(srv.url, fingerprint="another-model|int4|block32")
    assert other.get(h(1)) is None and not other.exists(h(1))
    assert store(srv.url, namespace="staging").get(h(1)) is None
    assert st.status == "up" and st.available


def test_ttl_expires_and_a_hit_renews_it(server):
    srv = server()
    st = store(srv.url, ttl_s=2)
    raw = redis.Redis.from_url(srv.url)
    assert st.put(h(1), payload(1)) and st.put(h(2), payload(2))
    assert 0 < raw.pttl(st.key(h(1))) <= 2000
    time.sleep(1.2)
    assert st.get(h(1)) == payload(1)  # renews h(1)'s TTL to 2 s; h(2) keeps ~0.8 s
    assert raw.pttl(st.key(h(1))) > 1500
    time.sleep(1.2)
    assert st.get(h(2)) is None and not st.exists(h(2))
    assert st.get(h(1)) == payload(1)


def test_password(server):
    srv = server(password="s3cret-pw")
    good = store(srv.url)
    assert good.put(h(1), payload(1)) and good.get(h(1)) == payload(1)
    for url in (srv.url.replace("s3cret-pw", "wrong"), srv.url.replace(":s3cret-pw@", "")):
        bad = store(url)
        assert not bad.put(h(2), payload(2)) and bad.get(h(1)) is None  # refused, not raised
        assert bad.status == "auth_failed", (bad.status, bad.detail)
        assert bad.counters()["remote_tier_auth_failed_errors_total"] == 1
        assert "s3cret" not in bad.url and "wrong" not in bad.url  # logs never show the password
    assert not good.exists(h(2))


def test_tls(server, tmp_path):
    if not tls_supported(require_server()):
        pytest.skip("this valkey/redis server was built without TLS")
    certs = make_certs(tmp_path)
    srv = server(password="pw", certs=certs)
    assert srv.url.startswith("rediss://")
    st = store(srv.url)
    assert st.put(h(1), payload(1)) and st.get(h(1)) == payload(1)
    plain = store(srv.url.replace("rediss://", "redis://").split("?")[0])  # no TLS on a TLS port
    assert plain.get(h(1)) is None and plain.status != "up"
    untrusted = store(srv.url.split("?")[0])  # TLS, but the server's CA is not trusted
    assert untrusted.get(h(1)) is None and untrusted.status == "tls_failed", untrusted.detail


def test_bad_values_are_dropped_never_returned(server):
    srv = server()
    st = store(srv.url)
    raw = redis.Redis.from_url(srv.url)
    assert st.put(h(1), payload(1)) and st.put(h(2), payload(2)) and st.put(h(3), payload(3))
    value = bytearray(raw.get(st.key(h(1))))
    value[HEADER_SIZE + 100] ^= 0xFF  # one flipped payload byte
    raw.set(st.key(h(1)), bytes(value))
    raw.set(st.key(h(2)), raw.get(st.key(h(2)))[:-10])  # cut short
    raw.set(st.key(h(3)), raw.get(st.key(h(2))))  # another block's value under this key
    other = store(srv.url, fingerprint="another-model")
    assert other.put(h(4), payload(4))
    raw.set(st.key(h(4)), raw.get(other.key(h(4))))  # another model's value under this model's key
    raw.set(st.key(h(5)), b"not a block")
    assert [st.get(h(i)) for i in range(1, 6)] == [None] * 5
    c = st.counters()
    assert (c["remote_tier_corrupt_dropped_total"], c["remote_tier_truncated_dropped_total"],
            c["remote_tier_foreign_dropped_total"]) == (3, 1, 1)
    assert not any(raw.exists(st.key(h(i))) for i in range(1, 6))  # deleted: the next get is a plain miss
    assert st.status == "up"


def test_server_down_then_back(server, caplog):
    srv = server()
    st = store(srv.url, timeout_s=0.3, retry_after_s=0.5)
    assert st.put(h(1), payload(1))
    srv.kill()
    caplog.set_level(logging.WARNING, logger="nanokv.cache_service.remote")
    for _ in range(20):
        for call in (lambda: st.get(h(1)), lambda: st.put(h(2), payload(2)), lambda: st.exists(h(1)),
                     lambda: st.get_many([h(1), h(2)])):
            t0 = time.monotonic()
            assert call() in (None, False, [None, None])
            assert time.monotonic() - t0 < 1.0
    assert st.status == "unreachable" and not st.available
    c = st.counters()
    assert c["remote_tier_unreachable_errors_total"] >= 1 and c["remote_tier_skipped_total"] >= 60
    assert c["remote_tier_not_stored_total"] == 20 and c["remote_tier_misses_total"] >= 20
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1  # one per state change
    srv.start()  # same port, empty (no persistence)
    time.sleep(0.6)  # past retry_after_s: the next call tries the store again
    assert st.get(h(1)) is None and st.status == "up"
    assert st.put(h(1), payload(1)) and st.get(h(1)) == payload(1)
    assert any("is back" in r.getMessage() for r in caplog.records)


def test_stalled_server_times_out(server):
    srv = server()
    st = store(srv.url, timeout_s=0.3, retry_after_s=30)
    assert st.put(h(1), payload(1))
    srv.pause()
    try:
        t0 = time.monotonic()
        assert st.get(h(1)) is None
        assert time.monotonic() - t0 < 1.0
        assert st.status == "timeout" and st.counters()["remote_tier_timeout_errors_total"] == 1
        t0 = time.monotonic()
        assert [st.get(h(1)) for _ in range(100)] == [None] * 100  # skipped while backing off
        assert time.monotonic() - t0 < 0.5
    finally:
        srv.resume()


def test_bad_config_names_the_field():
    for url, words in [("http://h:1", "scheme"), ("redis://", "host"), ("redis://h:99999", "port"),
                       ("redis://h:1/x", "database"), ("redis://h:1/0?ssl_ca_certs=/x", "rediss"),
                       ("rediss://h:1/0?foo=1", "unknown option"), ("", "URL")]:
        with pytest.raises(ConfigError, match=words) as e:
            check_url(url)
        assert e.value.field == "remote_cache_url"
    url = "rediss://h:1/0?ssl_ca_certs=/ca.pem&ssl_check_hostname=false"
    assert check_url(url) == url
    assert redacted("redis://:pw@h:1/0") == "redis://:***@h:1/0" and redacted("redis://h:1") == "redis://h:1"
    for kw, field in [({"ttl_s": 0}, "ttl_s"), ({"timeout_s": 0}, "timeout_s"), ({"namespace": "a:b"}, "namespace"),
                      ({"fingerprint": ""}, "fingerprint")]:
        with pytest.raises(ConfigError) as e:
            store("redis://127.0.0.1:1/0", **kw)
        assert e.value.field == field
    with pytest.raises(NanoKVError, match="block_hash"):
        store("redis://127.0.0.1:1/0").get(b"short")


@pytest.mark.skipif(os.environ.get("CI", "").lower() not in ("true", "1"), reason="only CI must have the server")
def test_ci_has_the_server():
    require_server()
