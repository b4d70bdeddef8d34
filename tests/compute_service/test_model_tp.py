"""Tensor-parallel layers: heads are dealt out by GQA group (unevenly where they must be), every
rank's shard is the right slice of the full weights, and gloo processes running tp=2 (and tp=4 on
6 q / 3 kv heads) reproduce the tp=1 logits (so the TP runner only has to start them)."""

from __future__ import annotations

import os

import pytest
import torch

from nanokv.compute_service.model.config import ModelConfig
from nanokv.compute_service.model.loader import random_model, random_state_dict
from nanokv.errors import NanoKVError


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


def test_head_ranges_deal_out_gqa_groups():
    smol = ModelConfig.preset("smollm2-135m")  # 9 q heads over 3 kv heads
    assert [smol.head_ranges(2, r) for r in range(2)] == [((0, 6), (0, 2)), ((6, 3), (2, 1))]
    assert [smol.head_ranges(3, r) for r in range(3)] == [((0, 3), (0, 1)), ((3, 3), (1, 1)), ((6, 3), (2, 1))]
    # tp > kv heads: kv head 0 is replicated on ranks 0 and 1, which split its 3 q heads 2 + 1
    assert [smol.head_ranges(4, r) for r in range(4)] == [
        ((0, 2), (0, 1)), ((2, 1), (0, 1)), ((3, 3), (1, 1)), ((6, 3), (2, 1))]
    qwen = ModelConfig.preset("qwen3-0.6b")  # even splits are unchanged
    assert qwen.heads_per_rank(2) == (8, 4) and qwen.head_ranges(16, 5) == ((5, 1), (2, 1))
    for name in ModelConfig.preset_names():
        cfg = ModelConfig.preset(name)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        for tp in range(1, cfg.num_attention_heads + 1):
            ranges = [cfg.head_ranges(tp, r) for r in range(tp)]
            q_heads = [h for (q0, nq), _ in ranges for h in range(q0, q0 + nq)]
            assert q_heads == list(range(cfg.num_attention_heads)), (name, tp)  # each q head once, in order
            for (q0, nq), (k0, nk) in ranges:  # local GQA: q head i uses local kv head i // (nq / nk)
                assert nq % nk == 0 and [(q0 + i) // group for i in range(nq)] == [
                    k0 + i // (nq // nk) for i in range(nq)], (name, tp)
            assert ranges[0][1][1] == max(nk for _, (_, nk) in ranges)  # rank 0's cache is the largest
        with pytest.raises(NanoKVError, match=f"more than num_attention_heads {cfg.num_attention_heads}"):
            cfg.heads_per_rank(cfg.num_attention_heads + 1)


@pytest.mark.parametrize("preset,tp", [("tiny-qwen3", 2), ("tiny-llama", 2), ("tiny-qwen3-kv3", 2),
                                       ("tiny-qwen3-kv3", 4)])
def test_rank_shards_slice_full_weights(preset, tp):
    cfg = ModelConfig.preset(preset)
    full = random_state_dict(cfg, seed=4, std=None)  # the weights random_model draws
    D, I, V = cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    pre = "model.layers.1."
    for r in range(tp):
        model = random_model(preset, seed=4, tp_rank=r, tp_size=tp)[0]
        p = _params(model)
        (q0, nq), (k0, nk) = cfg.head_ranges(tp, r)
        assert model.model.layers[1].self_attn.attn.num_kv_heads == nk
        qkv = p[pre + "self_attn.qkv_proj.weight"]
        assert qkv.shape[0] == (nq + 2 * nk) * D
        q, k, v = qkv.split([nq * D, nk * D, nk * D])
        assert torch.equal(q, full[pre + "self_attn.q_proj.weight"][q0 * D:(q0 + nq) * D])
        assert torch.equal(k, full[pre + "self_attn.k_proj.weight"][k0 * D:(k0 + nk) * D])
        assert torch.equal(v, full[pre + "self_attn.v_proj.weight"][k0 * D:(k0 + nk) * D])
        o = p[pre + "self_attn.o_proj.weight"]  # o_proj reads exactly this rank's q heads
        assert torch.equal(o, full[pre + "self_attn.o_proj.weight"][:, q0 * D:(q0 + nq) * D])
        gate_up = p[pre + "mlp.gate_up_proj.weight"]
        n = I // tp
        assert torch.equal(gate_up[:n], full[pre + "mlp.gate_proj.weight"][r * n:(r + 1) * n])
        assert torch.equal(gate_up[n:], full[pre + "mlp.up_proj.weight"][r * n:(r + 1) * n])
        down = p[pre + "mlp.down_proj.weight"]
        assert torch.equal(down, full[pre + "mlp.down_proj.weight"][:, r * n:(r + 1) * n])
        rows = -(-V // tp)
        real = max(0, min(rows, V - r * rows))
        names = ["model.embed_tokens.weight"] + ([] if cfg.tie_word_embeddings else ["lm_head.weight"])
        for name in names:
            assert torch.equal(p[name][:real], full[name][r * rows:r * rows + real])
            assert not p[name][real:].any()  # padding rows of the last rank


def test_forward_refuses_mismatched_tp_state():
    m, _ = random_model("tiny-qwen3", tp_rank=1, tp_size=2)
    with pytest.raises(RuntimeError, match="init_tensor_parallel"):
        m(torch.tensor([1, 2]), torch.tensor([0, 1]))


# presets each gloo world runs: 2 ranks split heads evenly (tiny-qwen3), replicate the one kv head
# (tiny-llama) or split unevenly (tiny-qwen3-kv3); 4 ranks replicate kv heads with 2 + 1 q heads
_WORLDS = {2: ("tiny-qwen3", "tiny-llama", "tiny-qwen3-kv3"), 4: ("tiny-qwen3-kv3",)}


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from helpers_model import PagedRunner

    from nanokv.compute_service.distributed import init_tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    init_tensor_parallel(rank, world)
    for preset in _WORLDS[world]:
        model, _ = random_model(preset, seed=11, tp_rank=rank, tp_size=world)
        r = PagedRunner(model, num_blocks=8, block_size=16)
        ids = list(range(7, 40))
        prefill = r.step(ids, 0, True)
        decode = r.step([5], len(ids), False)
        torch.save(torch.cat([prefill, decode]), os.path.join(out_dir, f"{preset}.{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(_WORLDS))
def test_tp_gloo_matches_tp1(tmp_path, world):
    import torch.multiprocessing as mp
    from helpers_model import PagedRunner

    mp.spawn(_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    for preset in _WORLDS[world]:
        r = PagedRunner(random_model(preset, seed=11)[0], num_blocks=8, block_size=16)
        ids = list(range(7, 40))
        ref = torch.cat([r.step(ids, 0, True), r.step([5], len(ids), False)])
        for rank in range(world):
            got = torch.load(tmp_path / f"{preset}.{rank}.pt")
            assert got.shape == ref.shape
            assert (got - ref).abs().max().item() < 1e-5, (preset, rank)
