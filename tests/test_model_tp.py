"""Tensor-parallel layers: every rank's shard is the right slice of the full weights, and two
gloo processes running tp=2 reproduce the tp=1 logits (so the TP runner only has to start them)."""

from __future__ import annotations

import os

import pytest
import torch

from nanokv.model.config import ModelConfig
from nanokv.model.loader import random_model, random_state_dict


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_rank_shards_slice_full_weights(preset):
    cfg = ModelConfig.preset(preset)
    full = random_state_dict(cfg, seed=4)
    ranks = [_params(random_model(preset, seed=4, tp_rank=r, tp_size=2)[0]) for r in range(2)]
    hq, hkv = cfg.heads_per_rank(2)
    D, I, V = cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    for r, p in enumerate(ranks):
        pre = "model.layers.1."
        qkv = p[pre + "self_attn.qkv_proj.weight"]
        q_full, k_full = full[pre + "self_attn.q_proj.weight"], full[pre + "self_attn.k_proj.weight"]
        kv_head = r if cfg.num_key_value_heads >= 2 else 0  # tiny-llama: its one kv head on both ranks
        assert torch.equal(qkv[: hq * D], q_full[r * hq * D:(r + 1) * hq * D])
        assert torch.equal(qkv[hq * D:(hq + hkv) * D], k_full[kv_head * D:(kv_head + hkv) * D])
        gate_up = p[pre + "mlp.gate_up_proj.weight"]
        half = I // 2
        assert torch.equal(gate_up[:half], full[pre + "mlp.gate_proj.weight"][r * half:(r + 1) * half])
        assert torch.equal(gate_up[half:], full[pre + "mlp.up_proj.weight"][r * half:(r + 1) * half])
        down = p[pre + "mlp.down_proj.weight"]
        assert torch.equal(down, full[pre + "mlp.down_proj.weight"][:, r * half:(r + 1) * half])
        emb = p["model.embed_tokens.weight"]
        rows = -(-V // 2)
        real = min(rows, V - r * rows)
        assert torch.equal(emb[:real], full["model.embed_tokens.weight"][r * rows:r * rows + real])
        assert not emb[real:].any()  # padding rows of the last rank


def test_forward_refuses_mismatched_tp_state():
    m, _ = random_model("tiny-qwen3", tp_rank=1, tp_size=2)
    with pytest.raises(RuntimeError, match="init_tensor_parallel"):
        m(torch.tensor([1, 2]), torch.tensor([0, 1]))


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from helpers_model import PagedRunner

    from nanokv.distributed import init_tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    init_tensor_parallel(rank, world)
    for preset in ("tiny-qwen3", "tiny-llama"):
        model, _ = random_model(preset, seed=11, tp_rank=rank, tp_size=world)
        r = PagedRunner(model, num_blocks=8, block_size=16)
        ids = list(range(7, 40))
        prefill = r.step(ids, 0, True)
        decode = r.step([5], len(ids), False)
        torch.save(torch.cat([prefill, decode]), os.path.join(out_dir, f"{preset}.{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_gloo_matches_tp1(tmp_path):
    import torch.multiprocessing as mp
    from helpers_model import PagedRunner

    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for preset in ("tiny-qwen3", "tiny-llama"):
        r = PagedRunner(random_model(preset, seed=11)[0], num_blocks=8, block_size=16)
        ids = list(range(7, 40))
        ref = torch.cat([r.step(ids, 0, True), r.step([5], len(ids), False)])
        for rank in range(2):
            got = torch.load(tmp_path / f"{preset}.{rank}.pt")
            assert got.shape == ref.shape
            assert (got - ref).abs().max().item() < 1e-5, (preset, rank)
