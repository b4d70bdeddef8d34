"""Sampling controls on the real model: seeds, filters, stops, logprobs, timings, the demo."""

from __future__ import annotations

import math
import subprocess
import sys

from nanokv.sampling import SamplingParams


def test_seeded_sampling_reproducible_and_batch_independent(llm, chat_ids):
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    a = llm.generate([chat_ids[0]], p, use_tqdm=False)[0].token_ids
    b = llm.generate([chat_ids[1], chat_ids[0], chat_ids[2]], p, use_tqdm=False)[1].token_ids
    assert a == b
    c = llm.generate([chat_ids[0]], SamplingParams(temperature=0.9, seed=99, max_tokens=24, ignore_eos=True),
                     use_tqdm=False)[0].token_ids
    assert c != a


def test_top_k_1_is_greedy(llm, chat_ids):
    g = llm.generate([chat_ids[3]], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    k1 = llm.generate([chat_ids[3]], SamplingParams(temperature=1.5, top_k=1, max_tokens=16, seed=3),
                      use_tqdm=False)[0]
    assert g.token_ids == k1.token_ids


def test_min_p_and_logprobs(llm, chat_ids):
    p = SamplingParams(temperature=1.0, min_p=0.3, seed=5, max_tokens=12, logprobs=3, ignore_eos=True)
    o = llm.generate([chat_ids[4]], p, use_tqdm=False)[0]
    assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids) == 12
    for tok, lp in zip(o.token_ids, o.logprobs):
        assert lp["token_id"] == tok
        assert lp["logprob"] <= 0.0 and len(lp["top"]) == 3
        best = max(lp["top"].values())
        # min_p = 0.3: every sampled token has prob >= 0.3 * the top prob
        assert lp["logprob"] >= best + math.log(0.3) - 1e-4


def test_stop_string_and_stop_token(llm, chat_ids):
    base = llm.generate([chat_ids[0]], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0]
    assert "Paris" in base.text
    cut = llm.generate([chat_ids[0]], SamplingParams(temperature=0.0, max_tokens=20, stop=["Paris"]),
                       use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and "Paris" not in cut.text and base.text.startswith(cut.text)
    second = base.token_ids[1]
    st = llm.generate([chat_ids[0]], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[second]),
                      use_tqdm=False)[0]
    assert st.token_ids == base.token_ids[:2] and st.finish_reason == "stop"


def test_eos_and_length_and_timings(llm, chat_ids):
    o = llm.generate([chat_ids[0]], SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)[0]
    assert o.finish_reason == "stop"  # the model ends its answer with <|im_end|>
    o2 = llm.generate([chat_ids[0]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert o2.finish_reason == "length" and len(o2.token_ids) == 3
    m = o2.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time


def test_cli_generate_answers_paris():
    r = subprocess.run([sys.executable, "-m", "nanokv.cli", "generate", "What is the capital of France?",
                        "--max-tokens", "32", "--num-gpu-blocks", "256"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
