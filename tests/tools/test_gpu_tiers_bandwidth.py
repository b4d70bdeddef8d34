"""The tier bandwidth section of nanokv_tools.bench.gpu_tiers on the CPU (the host copy path): every tier format
moves the blocks, the pool format byte for byte, the re-quantizing ones into the pool's format."""

from __future__ import annotations

import pytest
from nanokv_tools.bench.gpu_tiers import bandwidth


@pytest.mark.parametrize("fmt", ["pool", "int8", "int4"])
def test_bandwidth_times_each_tier_format(fmt: str) -> None:
    r = bandwidth("random:tiny-llama", 8, tier_format=fmt, device="cpu")
    assert r["tier_format"] == fmt and r["blocks"] == 8
    assert r["onload_ms"] > 0 and r["writeback_ms"] > 0
    # the pool format's loads and saves are checked byte for byte; the others are re-quantized
    assert r["bytes_exact"] is (True if fmt == "pool" else None)
    pool = bandwidth("random:tiny-llama", 8, device="cpu")["bytes"]
    assert (r["bytes"] == pool) if fmt == "pool" else (r["bytes"] < pool)
