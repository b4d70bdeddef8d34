"""The shared tier over TLS with a password, against a real Valkey/Redis server that requires a client
certificate (tests/helpers_valkey.py, certificates from tests/helpers_tls.py): the tier stores and
serves a block; a wrong password, no TLS, no client certificate or an untrusted server each leave the
tier skipped (a miss, a counter, one warning), never an exception in the serving path."""

from __future__ import annotations

import hashlib
import logging
import stat

import pytest

from nanokv.cache_service.tiers.remote_store import RemoteStore
from nanokv.cache_service.tiers.remote_tier import RemoteTier
from tests.helpers_valkey import Server, make_certs, require_tls

FP = "SmolLM2-135M|bf16|block16"
PAYLOAD_BYTES = 4096
PASSWORD = "tls-s3cret"


def h(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def payload(i: int) -> bytes:
    return (hashlib.sha256(f"kv {i}".encode()).digest() * (PAYLOAD_BYTES // 32))[:PAYLOAD_BYTES]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    exe = require_tls()
    folder = tmp_path_factory.mktemp("valkey-tls")
    srv = Server(exe, folder / "data", password=PASSWORD, certs=make_certs(folder / "certs"),
                 client_auth=True).start()
    yield srv
    srv.stop()


def tier(url: str) -> RemoteTier:
    return RemoteTier(RemoteStore(url, FP, timeout_s=1.0, retry_after_s=30.0), PAYLOAD_BYTES)


def test_keys_are_owner_only(server):
    assert server.certs is not None and server.certs.client is not None
    for key in (server.certs.key, server.certs.client.key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key


def test_the_tier_stores_and_serves_a_block_over_mutual_tls(server):
    assert server.url.startswith("rediss://:") and "ssl_certfile=" in server.url
    t = tier(server.url)
    try:
        t.write(h(1), payload(1))
        t.write(h(2), payload(2))
        t.close()  # the writer offers every queued block first
        reader = tier(server.url)
        assert reader.read_run([h(1), h(2), h(3)]) == [payload(1), payload(2)]
        c = reader.store.counters()
        assert c["remote_tier_hits_total"] == 2 and c["remote_tier_misses_total"] == 1
        assert reader.store.available and reader.store.status == "up"
        reader.close()
    finally:
        t.store.close()


def _without(url: str, *params: str) -> str:
    base, _, query = url.partition("?")
    kept = [p for p in query.split("&") if p.split("=")[0] not in params]
    return base + ("?" + "&".join(kept) if kept else "")


@pytest.mark.parametrize("case", ["wrong_password", "no_password", "no_tls", "no_client_cert", "untrusted"])
def test_a_refused_store_is_skipped_with_a_metric_and_one_warning(server, caplog, case):
    good = server.url
    url = {
        "wrong_password": good.replace(f":{PASSWORD}@", ":wrong@"),
        "no_password": good.replace(f":{PASSWORD}@", ""),
        "no_tls": good.replace("rediss://", "redis://").split("?")[0],  # plaintext to the TLS port
        "no_client_cert": _without(good, "ssl_certfile", "ssl_keyfile"),
        "untrusted": _without(good, "ssl_ca_certs"),  # the system's roots: the test CA is not among them
    }[case]
    t = tier(url)
    caplog.set_level(logging.WARNING, logger="nanokv.cache_service.remote")
    try:
        assert t.read_run([h(1)]) == []  # a miss, not an exception
        assert not t.store.available
        status = t.store.status
        want = {"wrong_password": {"auth_failed"}, "no_password": {"auth_failed"},
                "no_tls": {"unreachable", "timeout", "error"},
                "no_client_cert": {"tls_failed", "unreachable"}, "untrusted": {"tls_failed"}}[case]
        assert status in want, (status, t.store.detail)
        assert t.store.counters()[f"remote_tier_{status}_errors_total"] == 1
        # skipped from now on: no second attempt (nor warning) before retry_after_s
        assert t.read_run([h(1)]) == [] and t.store.get(h(1)) is None
        assert t.store.counters()["remote_tier_skipped_total"] == 1  # (read_run asks nothing while down)
        t.write(h(9), payload(9))  # a victim offered while the store is down: dropped, never raised
        warnings = [r for r in caplog.records if "shared KV tier" in r.getMessage()]
        assert len(warnings) == 1 and status in warnings[0].getMessage(), [r.getMessage() for r in warnings]
        assert PASSWORD not in warnings[0].getMessage()
    finally:
        t.close()
