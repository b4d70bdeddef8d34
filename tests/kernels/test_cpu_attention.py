"""The CPU fast path (nanokv.kernels.cpu_attention) equals the generic masked reference path."""

from __future__ import annotations

import pytest
import torch

from nanokv.kernels import cpu_attention, reference
from nanokv.kv.cache import allocate_layer_cache
from nanokv.kv.metadata import AttentionMetadata


def _batch(G: int, seqs: list[tuple[int, int, bool]], bs: int = 8, H: int = 2, D: int = 16, seed: int = 0):
    """seqs: (cached tokens, new tokens, is_prefill), prefills first. Blocks scattered at random."""
    g = torch.Generator().manual_seed(seed)
    cache = allocate_layer_cache(16, 64, H, bs, D, torch.float32, "cpu")
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    lens = [c + n for c, n, _ in seqs]
    nbs = [-(-L // bs) for L in lens]
    perm = torch.randperm(64, generator=g).tolist()
    tables = torch.full((len(seqs), max(nbs)), -1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(nbs):
        tables[i, :nb] = torch.tensor(perm[used:used + nb])
        used += nb
    qlens = [n for _, n, _ in seqs]
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    P = sum(p for _, _, p in seqs)
    md = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, num_prefills=P,
        num_prefill_tokens=qsl[P], num_decode_tokens=qsl[-1] - qsl[P], max_query_len=max(qlens),
        max_seq_len=max(lens), query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    q = torch.randn(qsl[-1], H * G, D, generator=g)
    return cache, md, q


@pytest.mark.parametrize("G", [1, 3])
def test_fast_path_matches_masked_reference(G: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # fresh prompt, chunk after a cached prefix (mid-block), last prompt token alone, decodes
    cache, md, q = _batch(G, [(0, 21, True), (13, 11, True), (30, 1, True), (4, 1, False), (57, 1, False)])
    assert cpu_attention.step_plan(md, cache.block_size) is not None
    fast = reference.paged_attention(q, cache, md, 0.25)
    monkeypatch.setattr(cpu_attention, "applies", lambda q, cache: False)
    slow = reference.paged_attention(q, cache, md, 0.25)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)


def test_holes_take_the_masked_path() -> None:
    cache, md, q = _batch(2, [(20, 1, False), (33, 1, False)])
    md.block_tables[1, 0] = -1  # a dropped block: keys there must be masked, not read
    assert cpu_attention.step_plan(md, cache.block_size) is None
    assert torch.isfinite(reference.paged_attention(q, cache, md, 0.25)).all()
