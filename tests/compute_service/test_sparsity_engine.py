"""Block sparsity in the engine, on the embedded SmolLM2-135M (small sizes, chunked prefill of 64):
s = 0 changes nothing, the blocks a sequence holds really fall (measured at every forward), a
sparsified block is never served as a prefix unless the reuse is exact, and hybrid's demoted blocks
really leave the pool for the INT4 store, whose slots all come back (finish, abort, preemption)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

import nanokv.config
from nanokv.config import EngineConfig
from nanokv.errors import ConfigError
from nanokv.gateway.engine import Engine, RequestOutput
from nanokv.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
INT8 = {"enable_compression": True, "quantization_bitwidth": 8}  # hybrid demotes INT8 blocks
BS, CHUNK = 16, 64
_IDS = itertools.count()


def _engine(blocks: int = 96, **kw) -> Engine:
    """A small engine; sparsity knobs sized for a 20-block prompt (the default protected set is larger)."""
    cfg = EngineConfig.from_kwargs(num_gpu_blocks=blocks, block_size=BS, max_num_batched_tokens=CHUNK,
                                   sparsity_options="sink_blocks=1,recent_blocks=4,min_ranked=0", **kw)
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
    from nanokv.compute_service.model.loader import load_tokenizer

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
    assert eng.sparsity is None and eng.local_compute.sparsity is None and eng.runner.attn_probe is None
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
    kw = INT8 if policy == "hybrid" else {}
    eng = _engine(compression_sparsity=0.5, sparsity_policy=policy, **kw)
    peaks = _watch_peak(eng)
    out = _generate(eng, prompt)
    n_full = (len(prompt) + GREEDY.max_tokens - 1) // BS
    assert dense_peak == -(-(len(prompt) + GREEDY.max_tokens - 1) // BS)  # 22 blocks held at once
    # after each step at most ceil(n/2) full blocks + the open one; a step then adds <= CHUNK/BS blocks
    assert max(peaks) <= math.ceil(0.5 * n_full) + 1 + CHUNK // BS
    assert max(peaks) < 0.75 * dense_peak
    sp = eng.sparsity  # the cache service's decisions
    assert sp is not None and max(sp.peak_blocks.values()) == max(peaks)  # its own record agrees
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


def _hybrid(blocks: int = 96) -> Engine:
    eng = _engine(blocks, compression_sparsity=0.5, sparsity_policy="hybrid", **INT8)
    assert eng.sparsity is not None and eng.sparsity.slots is not None  # the free list: the cache service's
    sp = eng.local_compute.sparsity
    assert sp is not None and sp.store is not None  # the tensors: the compute service's
    assert sp.store.num_slots == eng.sparsity.slots.num_slots
    return eng


def test_hybrid_needs_int8_layers():
    with pytest.raises(ConfigError, match="every KV layer"):
        _engine(compression_sparsity=0.5, sparsity_policy="hybrid")


def test_demoted_blocks_leave_the_pool_and_are_never_served(prompt):
    eng = _hybrid()
    sp, cm = eng.sparsity, eng.cache_manager
    assert sp is not None and sp.slots is not None
    moves: list[tuple[int, int, int]] = []  # (free blocks before, after, blocks demoted) per demotion call
    inner = sp._demote

    def demote(seq_id, logical, reply):
        before = cm.num_free_blocks()
        done = inner(seq_id, logical, reply)
        moves.append((before, cm.num_free_blocks(), len(done)))
        table = cm.block_table(seq_id)
        assert all(table[i] <= -2 for i in done)  # the entries now name store slots
        return done

    sp._demote = demote  # type: ignore[method-assign]
    copies: list[tuple[int, int]] = []  # what the compute service was asked to copy INT8 -> INT4
    csp = eng.local_compute.sparsity
    inner_copy = csp.demote

    def copy(pairs):
        copies.extend(pairs)
        inner_copy(pairs)

    csp.demote = copy  # type: ignore[method-assign]
    _generate(eng, prompt)
    assert sp.blocks_demoted > 0 and sp.demotions_refused == sp.demotions_store_full == 0
    assert sum(n for *_, n in moves) == sp.blocks_demoted == len(copies)  # every demotion copied, once
    assert all(after - before == n for before, after, n in moves)  # each demoted int8 block is back in the pool
    assert sp.slots.num_free() == sp.slots.num_slots and cm.num_used_blocks() == 0  # all slots came back
    # what the prefix cache serves is exact int8 data, never an int4 copy: the blocks computed before
    # the first hole, bit-identical to a dense int8 engine's (a demoted block's int8 original included)
    hit = _hit(eng, prompt)
    assert len(hit) == 2 * CHUNK // BS
    dense8 = _engine(**INT8)
    dense8.add_request("dense8", prompt[: len(hit) * BS + 1], SamplingParams(temperature=0.0, max_tokens=1))
    while dense8.has_unfinished_requests():
        dense8.step()
    ref = _hit(dense8, prompt)
    assert len(ref) == len(hit)
    for a, b in zip(eng.runner.kv_caches, dense8.runner.kv_caches):
        for x, y in ((a.k, b.k), (a.v, b.v), (a.k_scale, b.k_scale), (a.v_scale, b.v_scale)):
            assert torch.equal(x[hit], y[ref])


def test_hybrid_returns_every_block_and_slot_after_preemption_and_abort(prompt):
    """Three prompts in a pool too small for them: sequences are preempted (their blocks and store
    slots freed, then recomputed) and one is aborted mid-way. At every step the store's held slots are
    exactly the demoted entries of live tables; at the end every block and slot is back."""
    eng = _hybrid(blocks=24)
    sp, cm = eng.sparsity, eng.cache_manager
    assert sp is not None and sp.slots is not None
    store = sp.slots
    planner = eng.local_cache.planner
    inner = planner.plan

    def plan(req):  # after every plan: the held slots are exactly the demoted entries of live tables
        reply = inner(req)
        live = [b for s in list(planner._seqs) if cm.has_seq(s) for b in cm.block_table(s)]
        held = store.num_slots - store.num_free()
        assert held == sum(1 for b in live if b <= -2)  # no slot leaks, none double-booked
        assert len({b for b in live if b <= -2}) == held
        assert cm.num_used_blocks() == len({b for b in live if b >= 0})
        return reply

    planner.plan = plan  # type: ignore[method-assign]
    prompts = [prompt[k:k + 300] for k in (0, 7, 13)]  # no shared prefix
    for i, p in enumerate(prompts):
        eng.add_request(f"pre{i}", p, GREEDY)
    steps = 0
    finished: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o.token_ids
        steps += 1
        if steps == 25:
            eng.abort("pre2")
    assert cm.stats.preemptions > 0 and sp.blocks_demoted > 0
    assert set(finished) >= {"pre0", "pre1"} and all(len(finished[r]) == GREEDY.max_tokens for r in ("pre0", "pre1"))
    assert cm.num_used_blocks() == 0 and store.num_free() == store.num_slots
    assert store.num_slots == eng.local_compute.sparsity.store.num_slots
