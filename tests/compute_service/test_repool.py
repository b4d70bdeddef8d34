"""A pool change while serving (Engine.repool -> Compute.Repool -> Cache.Attach): requests in flight
are recomputed on the new pool and end with the same greedy tokens as without the change, through
the in-process services and through three processes over gRPC; the epoch moves on; a bad layout
is refused with the field named and changes nothing; a widened pool serves what a full-precision
engine serves."""

from __future__ import annotations

import pytest

from nanokv.compute_service.runner.model_runner import ModelRunner
from nanokv.config import EngineConfig
from nanokv.errors import NanoKVError
from nanokv.gateway.llm import LLM
from nanokv.launch import start_services
from nanokv.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
POOL = dict(num_gpu_blocks=24, block_size=16, max_num_batched_tokens=128, max_num_seqs=4)


def _run(engine, prompts, *, repool_after: int | None = None, params: SamplingParams = GREEDY,
         **repool_kw) -> dict[str, list[int]]:
    """Generate (greedily by default); after `repool_after` steps, change the pool with repool_kw."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        if steps == repool_after:
            outs += engine.repool(**repool_kw)
        for o in outs:
            if o.finished:
                done[o.request_id] = o.token_ids
    return done


@pytest.fixture(scope="module")
def prompts(chat_ids):
    return chat_ids[:4]


@pytest.fixture(scope="module")
def reference(prompts):
    return _run(LLM(**POOL).engine, prompts)


def test_repool_in_process_keeps_greedy_tokens(prompts, reference):
    eng = LLM(**POOL).engine
    epoch = eng.model_info.epoch
    got = _run(eng, prompts, repool_after=6, num_blocks=18)
    assert got == reference
    assert eng.num_blocks == 18 and eng.model_info.epoch > epoch
    stats = eng.stats()
    assert stats["kv_blocks_total"] == 18 and stats["kv_cache_usage"] == 0.0
    # the requests in flight were taken back and recomputed; not counted as preemptions (memory
    # pressure, which the adaptive controller reacts to)
    assert stats["recomputed_tokens"] > 0 and stats["preemptions"] == 0


def test_repool_refuses_a_bad_layout_and_changes_nothing(prompts, reference):
    eng = LLM(**POOL).engine
    layers = len(eng.model_info.layer_bits)
    epoch = eng.model_info.epoch
    for kw, field in ((dict(layer_bits=[8] * (layers - 1)), "layer_bits"),
                      (dict(layer_bits=[5] * layers), "layer_bits"),
                      (dict(num_blocks=-3), "num_blocks")):
        with pytest.raises(NanoKVError, match=field):
            eng.repool(**kw)
    assert eng.model_info.epoch == epoch and eng.num_blocks == POOL["num_gpu_blocks"]
    assert _run(eng, prompts) == reference


def test_repool_widening_serves_what_full_precision_serves(prompts):
    kw = dict(POOL, enable_compression=True, quantization_bitwidth=8)
    eng = LLM(**kw).engine
    layers = len(eng.model_info.layer_bits)
    assert eng.model_info.layer_bits == [8] * layers
    eng.repool(layer_bits=[16] * layers)  # the controller's "back off to a safer width", all layers
    assert eng.model_info.layer_bits == [16] * layers
    assert eng.stats()["compression_error"] == {}  # no quantized layer left
    full = _run(LLM(**POOL).engine, prompts[:2])
    assert _run(eng, prompts[:2]) == full


def test_repool_to_int4_rotates_values_in_the_hooks(prompts, monkeypatch):
    """A layer that did not start as int4 may become int4 through a repool: its weights carry no value
    rotation, so the hooks rotate its values; it serves what an int4 engine that rotates in the hooks
    (no rotation folded into its weights; batch-invariant kernels off in both) serves."""
    eng = LLM(**POOL).engine
    layers = len(eng.model_info.layer_bits)
    eng.repool(layer_bits=[4] * layers)
    assert eng.model_info.layer_bits == [4] * layers
    assert all(c.rotate_v for c in eng.runner.kv_caches)
    assert not any(h.rotate_v_in_weights for h in eng.runner.layer_hooks)
    got = _run(eng, prompts[:2])
    monkeypatch.setattr(ModelRunner, "fold_value_rotations", lambda self: None)
    ref = LLM(**POOL, enable_compression=True, quantization_bitwidth=4, batch_invariant=False).engine
    assert not any(h.rotate_v_in_weights for h in ref.runner.layer_hooks)
    assert got == _run(ref, prompts[:2])


def test_repool_through_three_processes(prompts, reference):
    cfg = EngineConfig.from_kwargs(**POOL).to_dict()
    with start_services(cfg) as svc:
        eng = LLM(**POOL, cache_address=svc.cache_address, compute_address=svc.compute_address).engine
        epoch = eng.model_info.epoch
        got = _run(eng, prompts, repool_after=6, num_blocks=18)
        assert got == reference
        assert eng.num_blocks == 18 and eng.model_info.epoch > epoch
        cache = eng.cache.stats()
        assert cache["attached_epoch"] == eng.model_info.epoch
        assert cache["kv_blocks_total"] == 18 and cache["kv_blocks_free"] == 18
        # and again, back up, with nothing in flight
        eng.repool(num_blocks=24)
        assert _run(eng, prompts[:2]) == {k: reference[k] for k in ("0", "1")}
        eng.shutdown()
