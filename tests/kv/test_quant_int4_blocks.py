"""int4 block format: per-channel keys quantized once per block when it fills, open blocks staged in
full precision, staging slots recycled; the torch path driven exactly as the runner drives it."""

from __future__ import annotations

import numpy as np
import torch

from nanokv.kernels import reference
from nanokv.kv import quant
from nanokv.kv.blockquant import quantize_filled
from nanokv.kv.cache import allocate_layer_cache
from nanokv.kv.staging import StageTable

H, BS, D = 2, 16, 64


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    """[n, H, D] keys shaped like real ones: channels of very different scale, slowly varying."""
    g = torch.Generator().manual_seed(seed)
    chan_scale = torch.logspace(-1, 1, D)[torch.randperm(D, generator=g)]
    drift = torch.randn(1, H, D, generator=g) * 3
    return drift + torch.randn(n, H, D, generator=g) * chan_scale


def _step(cache, k, v, slots: list[int]) -> list[int]:
    """One runner step: plan staging, store, (attention would read here), quantize filled, finish.
    Returns the step's filled blocks' last slots (what the GPU fill kernel gets in eager steps)."""
    sm = np.asarray(slots, dtype=np.int64)
    cache.stage.plan(sm)
    last = cache.stage.last_slots().tolist()
    reference.store_kvcache(k, v, cache, torch.from_numpy(sm))
    quantize_filled(cache)
    cache.stage.finish()
    return last


def test_channel_quant_roundtrip_and_beats_per_token_on_real_key_shapes():
    x = _keys(BS).transpose(0, 1)  # [H, bs, D]: one block per head
    packed, scale, zero = quant.quantize_int4_channels(x)
    assert packed.shape == (H, BS, D // 2) and scale.shape == zero.shape == (H, D)
    y = quant.dequantize_int4_channels(packed, scale, zero, torch.float32)
    bound = scale.float().unsqueeze(-2) * (0.5 + 15 * 2.0**-11) + zero.float().abs().unsqueeze(-2) * 2.0**-11
    assert bool(((y - x).abs() <= bound + 1e-6).all())
    per_tok = quant.dequantize_int4(*quant.quantize_int4(x), torch.float32)
    err_c = ((y - x).norm() / x.norm()).item()
    err_t = ((per_tok - x).norm() / x.norm()).item()
    assert err_c < 0.5 * err_t


def test_block_is_staged_until_full_then_quantized_once():
    cache = allocate_layer_cache(4, 8, H, BS, D, torch.float32, "cpu", rotate=False)
    k, v = _keys(2 * BS, 1), _keys(2 * BS, 2)
    # block 3 gets tokens 0..9 in one step, 10..15 plus block 5's first 4 in the next
    assert _step(cache, k[:10], v[:10], [3 * BS + i for i in range(10)]) == []
    assert cache.stage.num_staged == 1
    kg, vg = reference.gather_kv(cache, torch.tensor([3]), torch.float32)  # [1, H, bs, D]
    assert torch.equal(kg[0, :, :10], k[:10].transpose(0, 1))  # open block: exact
    assert int(cache.k_scale[3].count_nonzero()) == 0  # nothing quantized yet
    filled = _step(cache, k[10:20], v[10:20], [3 * BS + i for i in range(10, 16)] + [5 * BS + i for i in range(4)])
    assert filled == [3 * BS + BS - 1]
    assert cache.stage.num_staged == 1  # block 3 filled and left staging; block 5 is open
    codes, scale, zero = quant.quantize_int4_channels(k[:BS].transpose(0, 1))
    assert torch.equal(cache.k[3], codes) and torch.equal(cache.k_scale[3], scale)
    assert torch.equal(cache.k_zero[3], zero)
    vc, vs, vz = quant.quantize_int4(v[:BS].transpose(0, 1))
    assert torch.equal(cache.v[3], vc) and torch.equal(cache.v_scale[3], vs) and torch.equal(cache.v_zero[3], vz)
    kg, _ = reference.gather_kv(cache, torch.tensor([3, 5]), torch.float32)
    assert torch.equal(kg[1, :, :4], k[BS:BS + 4].transpose(0, 1))  # block 5 still exact
    rel = (kg[0] - k[:BS].transpose(0, 1)).norm() / k[:BS].norm()
    assert 0 < rel < 0.05
    frozen = [t[3].clone() for t in (cache.k, cache.k_scale, cache.k_zero, cache.v, cache.v_scale)]
    _step(cache, k[20:32], v[20:32], [5 * BS + i for i in range(4, 16)])  # fill block 5
    assert cache.stage.num_staged == 0
    for t, before in zip((cache.k, cache.k_scale, cache.k_zero, cache.v, cache.v_scale), frozen):
        assert torch.equal(t[3], before)  # never requantized


def test_staging_slots_of_ended_sequences_are_reclaimed():
    table = StageTable(num_blocks=8, num_slots=2, block_size=4, device="cpu")
    freed: set[int] = set()
    table.block_free = lambda b: b in freed
    table.plan(np.array([0, 1, 4 * 2 + 0]))  # blocks 0 and 2 open
    table.finish()
    assert table.num_staged == 2
    freed.update({0, 2})  # their sequences ended mid-block
    table.plan(np.array([4 * 6, 4 * 7]))  # two new open blocks: the pool must reclaim
    assert table.num_staged == 2 and int(table.stage_of[6]) >= 0 and int(table.stage_of[0]) == -1
    table.finish()
    try:
        table.plan(np.array([4 * 1]))  # nothing free and nothing reclaimable
    except RuntimeError as e:
        assert "staging full" in str(e)
    else:
        raise AssertionError("expected the staging pool to be full")


def test_deferred_stage_map_is_applied_before_reads_between_steps():
    """The runner defers the staging map's device updates to the next step's metadata copy; a read
    between steps (re-formatting a layer) must first apply them, or a block quantized by the last
    step would still be read from (and written to) staging."""
    from nanokv.kv import blockquant
    bs, D = 4, 8
    cache = allocate_layer_cache(4, 3, 1, bs, D, torch.float32, "cpu")
    st = cache.stage
    slots = np.arange(bs)  # one step fills block 0
    st.plan(slots, defer=True)
    st.apply(*(torch.from_numpy(a) for a in st.pending()))  # as build_metadata does
    k, v = torch.randn(2, bs, 1, D)
    reference.store_kvcache(k, v, cache, torch.arange(bs))
    quantize_filled(cache)
    st.finish(defer=True)
    assert int(st.stage_of[0]) >= 0  # not applied yet: it travels with the next step
    kg, _ = blockquant.gather(cache, torch.tensor([0]), torch.float32)
    assert int(st.stage_of[0]) == -1 and st.num_staged == 0
    codes, s, z = quant.quantize_int4_channels(k.permute(1, 0, 2)[None])  # [1, H, bs, D]
    want = quant.dequantize_int4_channels(codes, s, z, torch.float32)
    assert torch.equal(kg, want)  # the quantized block, not the full-precision staging copy
    assert not torch.equal(kg[0, 0], k.permute(1, 0, 2)[0])


def test_stage_map_updates_follow_the_host_state_in_any_order():
    """Queued changes of one block in one batch (staged, freed, staged again) leave the device map
    equal to the host bookkeeping."""
    st = StageTable(6, 6, 4, "cpu")
    st.plan(np.array([0, 1, 2, 3, 4]), defer=True)  # blocks 0 (filled) and 1 staged
    st.finish(defer=True)  # block 0 freed before anything reached the device
    st.apply(*(torch.from_numpy(a) for a in st.pending()))
    assert st.stage_of.tolist() == [-1, int(st._host[1]), -1, -1, -1, -1]
    st.finish(defer=True)
    st.plan(np.array([0, 1, 2, 3, 8]), defer=True)  # block 0 staged again and filled, block 2 staged
    st.finish(defer=True)  # block 0 freed again in the same batch
    st.plan(np.array([4]), defer=True)
    st.apply(*(torch.from_numpy(a) for a in st.pending()))
    assert st.stage_of.tolist() == st._host.astype(np.int32).tolist()
    assert int(st.stage_of[0]) == -1 and int(st.stage_of[2]) >= 0
    st.finish(defer=True)  # nothing filled: no change
    assert st.pending()[0].size == 0


def test_runner_hands_eager_steps_the_filled_blocks_last_slots():
    """An int4 step with prefills carries the last slot of each block it fills (the GPU fill kernel's
    compact input, md.extras["fill_slots"]); a decode-only step (the captured kind) does not."""
    from nanokv.compute_service.model.loader import random_model
    from nanokv.compute_service.runner.model_runner import ModelRunner
    from nanokv.config import EngineConfig

    model, mc = random_model("tiny-llama", torch.float32, torch.device("cpu"))
    r = ModelRunner(EngineConfig.from_kwargs(num_gpu_blocks=16, block_size=16, device="cpu", enable_compression=True,
                                             quantization_bitwidth=4), model, mc, torch.device("cpu"), torch.float32)
    # a 40-token prompt from position 0 (fills blocks 3 and 9, opens 11) and a decode at position 31 (fills 5)
    _, _, md, _ = r.build_metadata([(list(range(40)), 0, 40, [3, 9, 11], True),
                                    (list(range(32)), 31, 1, [4, 5], False)])
    assert sorted(md.extras["fill_slots"].tolist()) == [3 * 16 + 15, 5 * 16 + 15, 9 * 16 + 15]
    r.stage.finish()
    _, _, md, _ = r.build_metadata([(list(range(33)), 32, 1, [4, 5, 6], False)])
    assert "fill_slots" not in md.extras
