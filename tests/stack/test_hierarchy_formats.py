"""Compressed lower tiers (cpu_offload_kv_format, nanokv.kv.tier_transcode): an fp32 device pool (L1)
above a host tier (L2) that stores int8 or int4 blocks. L2 holds ~4x / ~6x the blocks of an fp32 L2
in the same bytes; a prompt whose blocks were pushed down is served from L2, dequantized into L1,
and answers as the full-precision run did, within the error `nanokv eval --lower-tier-format`
measures for that format (docs/quality.md, "Lower tiers"); no block stays pinned or leaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import nanokv.config
from nanokv.cache_service.storage import host_layout
from nanokv.cache_service.tiers.formats import KVShape, layer_block_bytes
from nanokv.config import ConfigError, EngineConfig
from nanokv.gateway.llm import LLM
from nanokv.kv import tier_transcode as tt
from nanokv.kv.cache import allocate_layer_cache
from nanokv.messages import PoolLayout
from nanokv.sampling import SamplingParams

SHAPE = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype_bytes=4)  # SmolLM2, fp32 CPU
FP32_BLOCK = 30 * layer_block_bytes(16, 3, 16, 64, 4)  # 737,280 bytes
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
# 4 L1 blocks: a ~40-token chat prompt and its answer take 3 (two full blocks stay cached), so two more
# prompts push the first one's second block (not the chat template's shared head, which stays hot) into L2
TIERED = dict(num_gpu_blocks=4, block_size=16, max_num_batched_tokens=64, max_num_seqs=1,
              eviction_policy="lru", cpu_offload_bytes=8 * FP32_BLOCK)
# how far the first answer token's log-probability may move when the prefix comes back from the tier:
# int8 rows round-trip with ~0.6% relative error, int4 with ~6-9% (the eval's KL: ~80x int8's)
MAX_LOGPROB_SHIFT = {"int8": 0.05, "int4": 1.0}


def _layout(bits: int = 16) -> PoolLayout:
    return PoolLayout(num_blocks=6, block_size=16, num_kv_heads=3, head_dim=64, layer_bits=[bits] * 30,
                      dtype="float32", device="cpu")


@pytest.mark.parametrize("fmt, bits", [("int8", 8), ("int4", 4)])
def test_host_layout_sizes_slots_for_the_tier_format(fmt, bits):
    from nanokv.cache_service.storage import HostSlots, PoolStorage
    from nanokv.compute_service.runner.tier_copies import tier_layout

    budget = 64 * FP32_BLOCK
    pool, _ = host_layout(_layout(), budget)
    l2, per_block = host_layout(_layout(), budget, fmt)
    assert l2.layer_bits == [bits] * 30
    want = SHAPE.num_layers * layer_block_bytes(bits, 3, 16, 64)  # formats.py's torch-free byte count
    assert HostSlots(PoolStorage(l2, False, 1)).slot_bytes == want
    assert per_block == pytest.approx(want, rel=0.01)  # (alignment)
    # ~1.94x / ~3.05x the blocks of bf16 (16-token blocks), twice that against this fp32 pool
    assert l2.num_blocks / pool.num_blocks >= {8: 3.8, 4: 5.5}[bits]
    # the compute service reads the tier's format off the segment's size
    from nanokv.kv.segment import pool_nbytes

    assert tier_layout(_layout(), l2.num_blocks, pool_nbytes(l2)) == l2
    assert tier_layout(_layout(), pool.num_blocks, pool_nbytes(pool)) == pool


def test_round_trip_is_the_formats_quantizer_in_any_basis():
    torch.manual_seed(0)
    fp = allocate_layer_cache(16, 4, 3, 16, 64, torch.float32, "cpu")
    fp.k.copy_(torch.randn(4, 3, 16, 64) * torch.linspace(0.1, 4.0, 64))  # outlier channels, as RoPE keys
    fp.v.copy_(torch.randn(4, 3, 16, 64))
    ids = torch.arange(4)
    k0, v0 = fp.k.clone(), fp.v.clone()
    for bits, tol in ((8, 0.01), (4, 0.12)):
        fields = tt.encode(*tt.read_blocks(fp, ids), tt.basis(fp), bits)
        # the tier block is a block of that pool format: the same fields, read back by its own reader
        host = allocate_layer_cache(bits, 4, 3, 16, 64, torch.float32, "cpu")
        assert set(fields) == set(host.block_fields)
        k, v = tt.decode(fields, bits, tt.basis(fp))
        err_k, err_v = float((k - k0).norm() / k0.norm()), float((v - v0).norm() / v0.norm())
        assert 0 < err_k < tol and 0 < err_v < tol, (bits, err_k, err_v)
        # into an int8 layer (rotated keys) and back: the same values up to int8's own rounding
        i8 = allocate_layer_cache(8, 4, 3, 16, 64, torch.float32, "cpu")
        tt.write_blocks(i8, ids, *tt.decode(fields, bits, tt.basis(i8)))
        k8, _ = tt.read_blocks(i8, ids)
        from nanokv.kv.rotation import rotation_matrix

        assert float((k8 @ rotation_matrix(64).T - k).norm() / k.norm()) < 0.01


@pytest.mark.parametrize("kw, msg", [
    (dict(cpu_offload_bytes=1 << 24, cpu_offload_kv_format="fp8"), "allowed values: pool, int8, int4"),
    (dict(cpu_offload_kv_format="int8"), "cpu_offload_bytes"),  # no host tier to store it in
])
def test_bad_tier_format_names_the_field(kw, msg):
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_kwargs(**kw)
    assert e.value.field == "cpu_offload_kv_format" and msg in str(e.value)


def test_disk_and_shared_tier_fingerprint_names_the_tier_format():
    from nanokv.cache_service.service import CacheService

    svc = CacheService(EngineConfig.from_kwargs().cache)
    fps = {fmt: svc._fingerprint(host_layout(_layout(), 64 * FP32_BLOCK, fmt)[0]) for fmt in tt.TIER_FORMAT_BITS}
    assert len(set(fps.values())) == 3  # a format change makes every stored block foreign
    # a same-format tier of a 16-bit pool names the pool's layout: files written before the field existed stay
    assert fps["pool"] == svc._fingerprint(_layout())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_compressed_host_tier_serves_a_prefix_at_the_measured_quality(fmt):
    from tests.conftest import PROMPTS

    llm = LLM(**dict(TIERED, cpu_offload_kv_format=fmt))
    prompts = [llm.engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    # the first answer is computed in full precision (nothing cached yet): the reference
    ref = [llm.generate([ids], GREEDY, use_tqdm=False)[0] for ids in prompts][0]
    again = llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0]
    tiers = again.cached_tokens_by_tier
    assert tiers is not None and tiers["L2"] >= 16, tiers  # the prefix came back from the int8/int4 tier
    assert ref.logprobs is not None and again.logprobs is not None
    # the first answer token reads every L2-served block: the same choice, a bounded shift of its probability
    assert again.token_ids[0] == ref.token_ids[0]
    shift = abs(again.logprobs[0]["logprob"] - ref.logprobs[0]["logprob"])
    assert shift <= MAX_LOGPROB_SHIFT[fmt], shift
    if fmt == "int8":  # int8's top-1 agreement is ~99.4% (docs/quality.md): the whole answer holds
        assert again.token_ids == ref.token_ids
    st = llm.engine.cache.stats()
    cap = st["tier_capacity_blocks"]["L2"]
    fp32_cap = host_layout(_layout(), TIERED["cpu_offload_bytes"])[0].num_blocks  # 7
    assert cap == host_layout(_layout(), TIERED["cpu_offload_bytes"], fmt)[0].num_blocks
    assert cap >= {"int8": 4.0, "int4": 5.5}[fmt] * fp32_cap  # int4: less the fixed staging of its layout
    assert st["tier_blocks"]["L2"] <= cap and st["tier_moved_blocks"]["L2->L1"] > 0
    assert st["kv_blocks_free"] == st["kv_blocks_total"]  # every L1 block back
    assert llm.engine.cache.tiers is not None and llm.engine.cache.tiers.pinned() == 0
    llm.engine.shutdown()


def test_eval_measures_a_prefix_served_from_each_tier_format(tmp_path):
    """`nanokv eval --lower-tier-format int8,int4` on 256 tokens: both rows scored (> 0, below the
    formats' targets), int4 costing more than int8, the tier's bytes per token in the row."""
    from nanokv_tools.eval.cli import main

    out = tmp_path / "r.json"
    corpus = str(Path(nanokv.config.__file__))  # a text every checkout has
    assert main(["--corpus", corpus, "--tokens", "256", "--context", "256", "--chunk", "64", "--block-size", "16",
                 "--passkey-lengths", "", "--lower-tier-format", "int8,int4", "--json", str(out),
                 "--no-progress"]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["settings"]}
    i8, i4 = rows["tier-int8"]["perplexity"], rows["tier-int4"]["perplexity"]
    assert 0 < i8["kl_mean"] < i4["kl_mean"]
    assert i8["kl_mean"] <= 0.002 and abs(i8["delta_ppl_pct"]) <= 0.1  # the INT8 targets
    assert i4["top1_agreement"] >= 0.9 and i8["top1_agreement"] >= 0.97
    assert rows["tier-int8"]["pct_of_bf16"] < 53 and rows["tier-int4"]["pct_of_bf16"] < 34
