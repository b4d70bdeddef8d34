"""batch_invariant=True (CPU): a token's result does not depend on what shares its step.

Bit-exact checks of the two parts (row-padded linear layers, tiled attention) on this machine's
CPU, then the engine on the embedded model with an int8 cache, where the default path changes
greedy tokens under chunked prefill (docs/quality.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from nanokv_tools.eval import invariance

from nanokv.compute_service.model.layers.linear import MergedColumnParallelLinear, linear
from nanokv.errors import ConfigError
from nanokv.kernels import cpu_invariant, reference
from nanokv.kv.cache import allocate_layer_cache
from nanokv.kv.metadata import AttentionMetadata, forward_context


@pytest.fixture
def invariant_mode():
    with forward_context(None, [], batch_invariant=True):
        yield


@pytest.mark.parametrize("k,n", [(576, 960), (576, 576), (1536, 576), (576, 49152)])
def test_linear_rows_do_not_depend_on_the_batch(invariant_mode, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(k + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(300, k, generator=g)
    full = linear(x, w)
    # (57-192 rows: where two MKL threads split the 1536-wide product's sums on an AVX-512 FP16 CPU)
    for m in [*range(1, 41), 57, 64, 100, 150, 192]:
        assert torch.equal(linear(x[7:7 + m], w), full[7:7 + m]), f"{m} rows"


def test_linear_rows_panel_path_and_plain_path_agree(invariant_mode) -> None:
    """The fused gate_up layer splits decode-sized batches into weight panels: same bits."""
    layer = MergedColumnParallelLinear(576, [1536, 1536])
    layer.weight.data.normal_(generator=torch.Generator().manual_seed(1))
    x = torch.randn(200, 576, generator=torch.Generator().manual_seed(2))
    full = layer(x)
    for m in (1, 3, 4, 6, 9, 16, 64, 65):
        assert torch.equal(layer(x[:m]), full[:m]), f"{m} rows"


def _seq_md(tables: list[list[int]], chunks: list[tuple[int, int]], decodes: bool = False) -> AttentionMetadata:
    """One step: chunks (cached, new) per sequence, all prefills (or all one-token decodes)."""
    qsl = [0]
    for _, n in chunks:
        qsl.append(qsl[-1] + n)
    lens = [c + n for c, n in chunks]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    return AttentionMetadata(slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=bt,
                             num_prefills=0 if decodes else len(chunks),
                             num_prefill_tokens=0 if decodes else qsl[-1], num_decode_tokens=qsl[-1] if decodes else 0,
                             max_query_len=max(n for _, n in chunks), max_seq_len=max(lens),
                             query_start_loc_cpu=qsl, seq_lens_cpu=lens)


@pytest.mark.parametrize("bits", [16, 8])
def test_attention_same_bits_whole_chunked_and_batched(bits: int) -> None:
    """A 300-token sequence attended whole, in uneven chunks (incl. one-token decodes), and next to
    another sequence: every query row is bit-identical; and it matches the reference."""
    g = torch.Generator().manual_seed(bits)
    H, G, D, bs, L = 3, 3, 64, 16, 300
    cache = allocate_layer_cache(bits, 40, H, bs, D, torch.float32, "cpu")
    tab_a = list(range(0, 19))  # 19 blocks >= 300 tokens
    tab_b = list(range(20, 27))
    for tab, n in ((tab_a, L), (tab_b, 100)):
        pos = torch.arange(n)
        slots = torch.tensor(tab)[pos // bs] * bs + pos % bs
        reference.store_kvcache(torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g), cache, slots)
    q = torch.randn(L, H * G, D, generator=g)
    whole = cpu_invariant.paged_attention(q, cache, _seq_md([tab_a], [(0, L)]), 0.125)
    ref = reference.paged_attention(q, cache, _seq_md([tab_a], [(0, L)]), 0.125)
    assert torch.allclose(whole, ref, atol=1e-5, rtol=1e-4)
    start = 0
    for n in (64, 5, 100, 1, 3, 126, 1):  # sums to 300
        md = _seq_md([tab_a], [(start, n)])
        assert torch.equal(cpu_invariant.paged_attention(q[start:start + n], cache, md, 0.125),
                           whole[start:start + n]), f"chunk at {start}"
        start += n
    qb = torch.randn(100, H * G, D, generator=g)
    for dec in (False, True):  # next to another sequence, as prefills and as a batch of decodes
        both = cpu_invariant.paged_attention(torch.cat([qb[-1:], q[-1:]]), cache,
                                             _seq_md([tab_b, tab_a], [(99, 1), (L - 1, 1)], dec), 0.125)
        assert torch.equal(both[1:], whole[-1:]), dec
        alone = cpu_invariant.paged_attention(qb[-1:], cache, _seq_md([tab_b], [(99, 1)], dec), 0.125)
        assert torch.equal(both[:1], alone), dec


def test_engine_int8_greedy_same_tokens_every_way(tmp_path: Path) -> None:
    """Embedded model, int8 cache: whole prompts, prefix hits, 64-token chunks and one prompt at a
    time give the same greedy tokens (with batch_invariant off, chunking changed 4 of 6 passages)."""
    out = tmp_path / "inv.json"
    assert invariance.main(["--bits", "8", "--prompts", "2", "--max-tokens", "24", "--batch-ways",
                            "--json", str(out)]) == 0  # batch_invariant auto: on for a compressed cache
    res = json.loads(out.read_text())["8"]
    for way in ("prefix_hit", "chunked_64", "one_by_one"):
        assert res[way]["first_difference"] == [None, None], way
    assert min(res["prefix_hit"]["cached_tokens"]) >= 256


def test_batch_invariant_is_cpu_torch_only_and_auto_follows_compression() -> None:
    from nanokv.gateway.llm import LLM
    with pytest.raises(ConfigError) as e:
        LLM(attention_backend="triton", batch_invariant=True)
    assert "batch_invariant" in str(e.value)
    with pytest.raises(ConfigError) as e:
        LLM(batch_invariant="yes")
    assert "batch_invariant" in str(e.value) and "null" in str(e.value)
    assert LLM(enable_compression=True).engine.runner.batch_invariant
    assert not LLM().engine.runner.batch_invariant
    assert not LLM(enable_compression=True, batch_invariant=False).engine.runner.batch_invariant
