"""nanokv_tools.bench.gpu_sparsity's CPU-runnable parts: one KV budget sizes every configuration, bad
flags are refused, and the --tiny smoke serves a hybrid run end to end and writes its JSON."""

from __future__ import annotations

import json

import pytest
from nanokv_tools.bench import gpu_sparsity

from nanokv.kv.cache import bytes_per_block
from nanokv.kv.demote import slot_bytes


def test_every_configuration_fits_the_same_kv_bytes():
    base = {"model": "random:qwen3-0.6b", "block_size": 16}
    budget = 8 << 30
    block = 28 * bytes_per_block(8, 8, 16, 128, None)  # Qwen3-0.6B: 28 layers, 8 KV heads, D 128
    sizes = {c: gpu_sparsity.engine_kw(c, 0.5, budget, base)["num_gpu_blocks"] for c in gpu_sparsity.CONFIGS}
    assert sizes["int8"] == sizes["streaming"] == sizes["attention"] == budget // block
    hybrid = gpu_sparsity.engine_kw("hybrid", 0.5, budget, base)
    assert hybrid["sparsity_policy"] == "hybrid" and hybrid["compression_sparsity"] == 0.5
    pool_and_store = sizes["hybrid"] * block + -(-sizes["hybrid"] // 2) * 28 * slot_bytes(8, 16, 128)
    assert budget - block < pool_and_store <= budget + 28 * slot_bytes(8, 16, 128)


def test_bad_flags_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        gpu_sparsity.main(["--configs", "int8,dense", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        gpu_sparsity.main(["--device", "cpu", "--tiny", "--workloads", "chat", "--out", str(tmp_path)])


def test_tiny_hybrid_run_writes_its_json(tmp_path):
    rc = gpu_sparsity.main(["--device", "cpu", "--tiny", "--workloads", "longctx", "--configs", "hybrid",
                            "--sample-every", "1", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "sparsity.json").read_text())
    (run,) = res["serving"]
    assert run["config"] == "hybrid@0.5" and run["num_seqs"] == 4 and run["preemptions"] >= 0
    assert run["output_tokens_per_s"] > 0 and 0 < run["ttft_p50_s"] <= run["ttft_p99_s"]
    assert run["max_running"] >= 1 and run["max_seq_kv_bytes"] > 0
    assert run["sparsity"]["blocks_demoted"] > 0
