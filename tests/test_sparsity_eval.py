"""`nanokv eval --compression-sparsity ... --sparsity-policy ...` end to end on a tiny budget: every
(policy, s) pair gets a row next to its dense setting, sparse rows really read a sparse cache (they
score worse than dense) and hold fewer live bytes, measured; hybrid holds the fewest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import nanokv.config
from nanokv.errors import NanoKVError
from nanokv.eval.cli import main, parser, sparsity_variants

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
    for r in (stream, hybrid):  # they really read the sparse cache
        assert r["perplexity"]["kl_mean"] > dense["perplexity"]["kl_mean"]
        assert r["passkey"] is not None and r["peak_kv_blocks"]["passkey"] <= dense["peak_kv_blocks"]["passkey"]


def test_bad_sparsity_flags_are_rejected():
    for argv in (["--compression-sparsity", "1.0"], ["--compression-sparsity", "x"],
                 ["--sparsity-policy", "lru"], ["--sparsity-score", "mean", "--compression-sparsity", "0.5"]):
        with pytest.raises(NanoKVError):
            sparsity_variants(parser().parse_args(argv))
    args = parser().parse_args(["--compression-sparsity", "0.25,0.5", "--sparsity-policy", "interval,attention"])
    got = [(p.policy, p.sparsity) for p in sparsity_variants(args)]
    assert got == [("interval", 0.25), ("interval", 0.5), ("attention", 0.25), ("attention", 0.5)]
