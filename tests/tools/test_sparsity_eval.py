"""`nanokv eval --compression-sparsity ... --sparsity-policy ...` end to end on a tiny budget: every
(policy, s) pair gets a row next to its dense setting, sparse rows really read a sparse cache (they
score worse than dense) and hold fewer live bytes, measured; hybrid holds the fewest, its demoted
blocks held as INT4 store slots."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from nanokv_tools.eval.cli import main, parser, sparsity_variants
from nanokv_tools.eval.report import table
from nanokv_tools.eval.sparse import SparseView

import nanokv.config
from nanokv.compute_service.sparsity.accounting import KVBytes
from nanokv.errors import NanoKVError
from nanokv.kv.cache import allocate_layer_cache
from nanokv.kv.demote import DemotionStore
from nanokv.sparsity import SparsityParams

CORPUS = str(Path(nanokv.config.__file__))  # a text every checkout has


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("eval") / "r.json"
    rc = main(["--corpus", CORPUS, "--tokens", "383", "--context", "384", "--chunk", "32",
               "--compression-sparsity", "0,0.5", "--sparsity-policy", "streaming,hybrid",
               "--sparsity-recent", "2", "--sparsity-sinks", "1", "--sparsity-min-ranked", "0",
               "--passkey-lengths", "128", "--passkey-trials", "1", "--json", str(out), "--no-progress",
               "--block-size", "16"])  # the block counts below are for 16-token blocks
    assert rc == 0
    return json.loads(out.read_text())


def _row(result: dict, name: str) -> dict:
    return next(r for r in result["settings"] if r["name"] == name)


def test_rows_and_measured_peaks(result):
    names = [r["name"] for r in result["settings"]]
    assert names == ["fp (reference)", "int8", "int8 streaming@0.5", "int8 hybrid@0.5"]
    dense, stream, hybrid = (_row(result, n) for n in names[1:])
    # a 384-token window is 24 blocks: dense holds all of them at the end
    assert dense["peak_kv_blocks"]["perplexity"] == 24
    assert dense["peak_kv_bytes"]["perplexity"] == 24 * 16 * dense["bytes_per_token"]
    # s = 0.5: ceil(23 / 2) full blocks after each step, + the 2 blocks a 32-token chunk adds
    assert stream["peak_kv_blocks"]["perplexity"] <= 12 + 2
    assert stream["peak_vs_dense"]["perplexity"] < 0.6
    assert hybrid["peak_kv_bytes"]["perplexity"] < stream["peak_kv_bytes"]["perplexity"]
    assert 0.2 < stream["mean_fraction"]["perplexity"]["dropped"] < 0.5
    assert hybrid["mean_fraction"]["perplexity"]["demoted"] > 0
    # at the window's end the budget is reached: ceil(n / 2) of its n full blocks kept (n = 23 or 24)
    for r in (stream, hybrid):
        assert r["end_fraction"]["perplexity"]["dropped"] in (11 / 23, 12 / 24)
        assert r["end_fraction"]["perplexity"]["dropped"] > r["mean_fraction"]["perplexity"]["dropped"]
    assert stream["end_fraction"]["perplexity"]["demoted"] == 0 < hybrid["end_fraction"]["perplexity"]["demoted"]
    # every row's peak against the reference's dense cache counted as bf16, on the same window
    fp = _row(result, "fp (reference)")
    assert fp["peak_vs_bf16"]["perplexity"] == 1.0
    assert dense["peak_vs_bf16"]["perplexity"] == pytest.approx(dense["bytes_per_token"] / fp["bytes_per_token"])
    assert stream["peak_vs_bf16"]["perplexity"] == pytest.approx(
        stream["peak_vs_dense"]["perplexity"] * dense["peak_vs_bf16"]["perplexity"])
    for r in (stream, hybrid):  # they really read the sparse cache
        assert r["perplexity"]["kl_mean"] > dense["perplexity"]["kl_mean"]
        assert r["passkey"] is not None and r["peak_kv_blocks"]["passkey"] <= dense["peak_kv_blocks"]["passkey"]


def test_printed_table_carries_the_fractions_and_peaks(result):
    lines = table(result).splitlines()
    head = lines[0].split()
    for col in ("vs", "bf16", "dense", "drop", "demote", "mean", "end"):
        assert col in head
    hybrid = _row(result, "int8 hybrid@0.5")
    row = next(line for line in lines if line.startswith("int8 hybrid@0.5"))
    for x in (hybrid["peak_vs_bf16"]["perplexity"], hybrid["peak_vs_dense"]["perplexity"],
              hybrid["mean_fraction"]["perplexity"]["dropped"], hybrid["end_fraction"]["perplexity"]["demoted"]):
        assert f"{x:.3f}" in row.split()
    assert next(line for line in lines if line.startswith("int8 ")).split()[6:10] == ["-"] * 4  # dense: no drops


def test_bad_sparsity_flags_are_rejected():
    for argv in (["--compression-sparsity", "1.0"], ["--compression-sparsity", "x"],
                 ["--sparsity-policy", "lru"], ["--sparsity-score", "mean", "--compression-sparsity", "0.5"]):
        with pytest.raises(NanoKVError):
            sparsity_variants(parser().parse_args(argv))
    args = parser().parse_args(["--compression-sparsity", "0.25,0.5", "--sparsity-policy", "interval,attention"])
    got = [(p.policy, p.sparsity) for p in sparsity_variants(args)]
    assert got == [("interval", 0.25), ("interval", 0.5), ("attention", 0.25), ("attention", 0.5)]


def test_view_moves_demoted_blocks_to_the_store_and_gives_the_slots_back():
    """The eval's per-setting view demotes as the engine does: the entry names a store slot, the
    live bytes count the slot (not the int8 block), a later drop and close() give the slots back."""
    H, D, n = 2, 8, 24
    caches = [allocate_layer_cache(8, n, H, 16, D, torch.float32, "cpu") for _ in range(2)]
    store = DemotionStore(caches, n)
    params = SparsityParams(0.5, "hybrid", sink_blocks=1, recent_blocks=2, min_ranked=0)
    kb = KVBytes([8, 8], H, 16, D)
    view = SparseView(params, SimpleNamespace(demotion_store=store, attn_probe=None), list(range(n)), kb)
    released = 0
    for t in range(32, 16 * n + 1, 32):
        before = store.num_free()
        demoted_before = set(view.state.demoted) if view.state else set()
        view.after_step(t)
        assert view.state is not None
        released += len(demoted_before & view.state.dropped)  # demoted, then dropped: slot back
        assert store.num_free() == before + len(demoted_before & view.state.dropped) \
            - len(view.state.demoted - demoted_before)
    st = view.state
    assert st is not None and st.demoted and released > 0
    assert all(view.table[i] <= -2 for i in st.demoted) and all(view.table[i] == -1 for i in st.dropped)
    assert store.num_slots - store.num_free() == len(st.demoted)
    kept8 = n - len(st.dropped) - len(st.demoted)
    assert kb.live(view.table, 16 * n) == kept8 * kb.block_bytes + len(st.demoted) * kb.demoted_block_bytes
    assert kb.demoted_block_bytes == store.bytes_per_slot < kb.block_bytes
    view.close()
    assert store.num_free() == store.num_slots and min(view.table) >= -1
