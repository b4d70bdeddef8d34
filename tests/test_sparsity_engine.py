"""Block sparsity in the engine, on the embedded SmolLM2-135M (small sizes, chunked prefill of 64):
s = 0 changes nothing, the blocks a sequence holds really fall (measured at every forward), and a
sparsified or demoted block is never served as a prefix unless the reuse is exact."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

import nanokv.config
from nanokv.config import EngineConfig
from nanokv.engine.engine import Engine, RequestOutput
from nanokv.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BS, CHUNK = 16, 64
_IDS = itertools.count()


def _engine(**kw) -> Engine:
    """A small engine; sparsity knobs sized for a 20-block prompt (the default protected set is larger)."""
    cfg = EngineConfig.from_kwargs(num_gpu_blocks=96, block_size=BS, max_num_batched_tokens=CHUNK, **kw)
    cfg.extra["sparsity"] = {"sink_blocks": 1, "recent_blocks": 4, "min_ranked": 0}
    return Engine(cfg)


def _generate(eng: Engine, prompt: list[int], salt: str | None = None) -> RequestOutput:
    rid = f"r{next(_IDS)}"
    eng.add_request(rid, prompt, GREEDY, cache_salt=salt)
    done = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done = o
    assert done is not None and done.request_id == rid
    return done


def _watch_peak(eng: Engine) -> list[int]:
    """Record the blocks in use at every forward (after the scheduler grew the tables, before any
    drop): the engine's real peak, whatever the sparsity code believes."""
    seen: list[int] = []
    inner = eng.runner.execute

    def execute(*a, **kw):
        seen.append(eng.cache_manager.num_used_blocks())
        return inner(*a, **kw)

    eng.runner.execute = execute
    return seen


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    from nanokv.model.loader import load_tokenizer

    ids = load_tokenizer(None)(Path(nanokv.config.__file__).read_text(), add_special_tokens=False)["input_ids"]
    return list(ids[:330])  # 20 full blocks + 10 tokens


@pytest.fixture(scope="module")
def dense(prompt):
    eng = _engine()
    peaks = _watch_peak(eng)
    out = _generate(eng, prompt)
    return eng, out, max(peaks)


def test_s0_is_the_engine_without_the_feature(prompt, dense):
    _, want, _ = dense
    eng = _engine(compression_sparsity=0.0, sparsity_policy="hybrid")
    assert eng.sparsity is None and eng.runner.attn_probe is None
    assert _generate(eng, prompt).token_ids == want.token_ids
    # s > 0 on a sequence whose blocks are all protected (sink + 4 recent): the probe runs, nothing drops
    short = prompt[:50]
    base = _generate(dense[0], short, salt="no-hit").token_ids
    sp = _engine(compression_sparsity=0.5, sparsity_policy="attention")
    assert _generate(sp, short).token_ids == base
    assert sp.sparsity is not None and sp.sparsity.blocks_dropped == 0


@pytest.mark.parametrize("policy", ["streaming", "attention", "hybrid"])
def test_peak_blocks_per_sequence_fall(prompt, dense, policy):
    _, _, dense_peak = dense
    kw = {"enable_compression": True, "quantization_bitwidth": 8} if policy == "hybrid" else {}
    eng = _engine(compression_sparsity=0.5, sparsity_policy=policy, **kw)
    peaks = _watch_peak(eng)
    out = _generate(eng, prompt)
    n_full = (len(prompt) + GREEDY.max_tokens - 1) // BS
    assert dense_peak == -(-(len(prompt) + GREEDY.max_tokens - 1) // BS)  # 22 blocks held at once
    # after each step at most ceil(n/2) full blocks + the open one; a step then adds <= CHUNK/BS blocks
    assert max(peaks) <= math.ceil(0.5 * n_full) + 1 + CHUNK // BS
    assert max(peaks) < 0.75 * dense_peak
    sp = eng.sparsity
    assert sp is not None and sp.peak_blocks[out.request_id] == max(peaks)  # the engine's own record agrees
    assert sp.blocks_dropped >= n_full // 2 - 1
    if policy == "hybrid":
        assert sp.blocks_demoted > 0
    assert len(out.token_ids) == GREEDY.max_tokens and eng.cache_manager.num_used_blocks() == 0


def _hit(eng: Engine, ids: list[int]) -> list[int]:
    return eng.cache_manager.match_prefix(ids).block_ids


def test_sparsified_prefix_is_served_only_where_exact(prompt, dense):
    dense_eng, _, _ = dense
    eng = _engine(compression_sparsity=0.5, sparsity_policy="streaming")
    _generate(eng, prompt)
    # chunk 1 (blocks 0-3) and chunk 2 (4-7) ran on a dense context and were published; then blocks
    # 1-3 were dropped (kept cached: their content is intact), and nothing computed after that hole
    # read a full context, so nothing after it was published
    hit = _hit(eng, prompt)
    assert len(hit) == 2 * CHUNK // BS
    ref = _hit(dense_eng, prompt)[: len(hit)]
    for a, b in zip(eng.runner.kv_caches, dense_eng.runner.kv_caches):
        assert torch.equal(a.k[hit], b.k[ref]) and torch.equal(a.v[hit], b.v[ref])  # bit-exact reuse
    assert _generate(eng, prompt).num_cached_tokens == len(hit) * BS


def test_demoted_blocks_are_never_served(prompt):
    eng = _engine(compression_sparsity=0.5, sparsity_policy="hybrid", enable_compression=True,
                  quantization_bitwidth=8)
    assert eng.sparsity is not None
    seen_demoted: set[int] = set()
    inner = eng.sparsity._apply

    def apply(seq_id, st, num_computed):
        inner(seq_id, st, num_computed)
        table = eng.cache_manager.block_table(seq_id)
        seen_demoted.update(table[i] for i in st.demoted)

    eng.sparsity._apply = apply  # type: ignore[method-assign]
    _generate(eng, prompt)
    assert seen_demoted and eng.sparsity.demotions_refused == 0
    pool = eng.cache_manager.pool
    assert all(pool.hash[b] is None for b in seen_demoted)  # unpublished before being rewritten
    hit = _hit(eng, prompt)
    assert hit and not set(hit) & seen_demoted
    assert _generate(eng, prompt).num_cached_tokens == len(hit) * BS
