"""The shared tier's bench (nanokv_tools.bench.shared_tier_bench) against a real Valkey/Redis server:
every block put comes back, in runs, and the figures are the ones docs/operating.md quotes."""

from __future__ import annotations

import pytest
from nanokv_tools.bench.shared_tier_bench import measure_store

from tests.helpers_valkey import Server, require_server


def test_store_figures_from_a_real_server(tmp_path):
    server = Server(require_server(), tmp_path / "valkey").start()
    try:
        res = measure_store(server.url, blocks=5, payload_bytes=4096, run=2)  # runs of 2, 2 and 1
    finally:
        server.stop()
    assert res["payload_bytes"] == 4096
    assert res["put_ms_per_block"] > 0 and res["get_ms_per_block"] > 0
    assert res["get_MBps"] == pytest.approx(5 * 4096 / 1e6 / (res["get_ms_per_block"] * 5 / 1e3))
