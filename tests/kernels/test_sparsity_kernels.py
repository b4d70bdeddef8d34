"""Holes and mixed formats on the read paths: dropped blocks (-1 table entries) read nothing and move
no position, on the torch reference and on the Triton kernels (CPU: TRITON_INTERPRET=1, tiny sizes);
INT8 blocks demoted into the INT4 demotion store (table entries <= -2) read back from it on the
torch path; the attention probe measures exactly the softmax mass attention puts on each block."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs

from nanokv.compute_service.sparsity.probe import AttentionProbe  # noqa: E402
from nanokv.errors import ConfigError, NanoKVError  # noqa: E402
from nanokv.kernels import reference  # noqa: E402
from nanokv.kv import demote, quant  # noqa: E402
from nanokv.kv.blockquant import quantize_filled  # noqa: E402
from nanokv.kv.cache import Int4KV, LayerKV, allocate_layer_cache, bytes_per_block  # noqa: E402
from nanokv.kv.metadata import AttentionMetadata  # noqa: E402
from nanokv.sparsity import params_of  # noqa: E402

BS, H, G, D = 8, 2, 2, 32


def _batch(bits: int, specs: list[tuple[int, int]], holes: list[list[int]], num_prefills: int, seed: int = 0,
           ) -> tuple[LayerKV, AttentionMetadata, torch.Tensor, list[torch.Tensor]]:
    """specs: (cached, new) per sequence; holes: logical blocks dropped per sequence. Returns the cache,
    metadata, q [T, H*G, D] and each sequence's true K/V [2, L, H, D] as stored (dequantized)."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-(c + n) // BS) for c, n in specs]
    cache = allocate_layer_cache(bits, sum(nbs) + 1, H, BS, D, torch.float32, "cpu", rotate=False)
    perm = torch.randperm(sum(nbs) + 1, generator=g).tolist()
    tables = torch.full((len(specs), max(nbs)), -1, dtype=torch.int32)
    new_slots, stored = [], []
    for i, (c, n) in enumerate(specs):
        ids = [perm.pop() for _ in range(nbs[i])]
        pos = torch.arange(c + n)
        slots = torch.tensor(ids)[pos // BS] * BS + pos % BS
        kv = torch.randn(2, c + n, H, D, generator=g)
        if isinstance(cache, Int4KV):  # int4 as the runner stores: the blocks earlier steps filled are
            # quantized, this step's stay staged until after its attention (what the kernels rely on)
            for earlier, part in ((True, slice(0, c)), (False, slice(c, c + n))):
                cache.stage.plan(slots[part].numpy())
                reference.store_kvcache(kv[0][part], kv[1][part], cache, slots[part])
                if earlier:
                    quantize_filled(cache)
                    cache.stage.finish()
        else:
            reference.store_kvcache(kv[0], kv[1], cache, slots)
        k, v = reference.gather_kv(cache, torch.tensor(ids), torch.float32)
        stored.append(torch.stack([k.transpose(1, 2).reshape(-1, H, D), v.transpose(1, 2).reshape(-1, H, D)]))
        for h in holes[i]:
            ids[h] = -1
        tables[i, :nbs[i]] = torch.tensor(ids, dtype=torch.int32)
        new_slots.append(slots[c:])
    qsl = [0]
    for _, n in specs:
        qsl.append(qsl[-1] + n)
    lens = [c + n for c, n in specs]
    md = AttentionMetadata(
        slot_mapping=torch.cat(new_slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, num_prefills=num_prefills,
        num_prefill_tokens=qsl[num_prefills], num_decode_tokens=qsl[-1] - qsl[num_prefills],
        max_query_len=max(n for _, n in specs), max_seq_len=max(lens), query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    return cache, md, torch.randn(qsl[-1], H * G, D, generator=g), stored


def _explicit(q: torch.Tensor, md: AttentionMetadata, stored: list[torch.Tensor], holes: list[list[int]],
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Plain softmax attention over the kept keys only (true positions, causal) -> out [T, Hq, D] and
    each sequence's weights [Hq, n, L]."""
    out, weights = torch.empty_like(q), []
    for i, kv in enumerate(stored):
        s, e, L = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1], md.seq_lens_cpu[i]
        kpos, qpos = torch.arange(L), torch.arange(L - (e - s), L)
        ok = (kpos[None, :] <= qpos[:, None]) & ~torch.isin(kpos // BS, torch.tensor(holes[i], dtype=torch.long))
        k, v = kv[0].repeat_interleave(G, dim=1)[:L], kv[1].repeat_interleave(G, dim=1)[:L]  # [L, Hq, D]
        logits = torch.einsum("nhd,lhd->hnl", q[s:e], k) * D ** -0.5
        w = torch.softmax(logits.masked_fill(~ok, float("-inf")), dim=-1)
        out[s:e] = torch.einsum("hnl,lhd->nhd", w, v)
        weights.append(w)
    return out, weights


# a prefill chunk reading a streaming-sparse context, a fresh prompt, and decodes with many holes
SPECS = [(40, 9), (0, 13), (63, 1), (30, 1)]
HOLES = [[1, 2, 3], [], [1, 2, 4, 5], [0, 2]]


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_reference_masks_holes_and_keeps_positions(bits):
    cache, md, q, stored = _batch(bits, SPECS, HOLES, num_prefills=2)
    got = reference.paged_attention(q, cache, md, D ** -0.5)
    want, _ = _explicit(q, md, stored, HOLES)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_triton_reads_holes_without_a_copy(bits):
    pytest.importorskip("triton")
    from nanokv.kernels.triton_backend import TritonBackend
    from nanokv.kernels.triton_config import TritonConfig

    cfg = TritonConfig(decode_block_n=16, quant_block_n=16, decode_splits=2, prefill_block_m=16, prefill_block_n=16,
                       sdpa_prefill_min_tokens=0)
    cache, md, q, stored = _batch(bits, SPECS, HOLES, num_prefills=2, seed=1)
    out = torch.full_like(q, float("nan"))
    TritonBackend(cfg).paged_attention(q, cache, md, D ** -0.5, out=out)
    want, _ = _explicit(q, md, stored, HOLES)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_runner_positions_and_slots_stay_true_with_holes():
    from nanokv.compute_service.model.loader import random_model
    from nanokv.compute_service.runner.model_runner import ModelRunner
    from nanokv.config import EngineConfig

    model, mc = random_model("tiny-llama", torch.float32, torch.device("cpu"))
    r = ModelRunner(EngineConfig.from_kwargs(num_gpu_blocks=16, block_size=16, device="cpu"), model, mc,
                    torch.device("cpu"), torch.float32)
    table = [3, -1, -1, 7, 9]  # blocks 1, 2 dropped
    ids, pos, md, _ = r.build_metadata([(list(range(80)), 70, 5, table, True)])
    assert pos.tolist() == list(range(70, 75))
    assert md.slot_mapping.tolist() == [9 * 16 + p % 16 for p in range(70, 75)]
    assert md.block_tables.tolist() == [table] and md.seq_lens_cpu == [75]


def test_demoted_blocks_read_back_from_the_int4_store():
    """A demoted entry (-2 - slot) reads the demotion store, with the values the former in-place
    format held: the per-row int4 quantization of the dequantized int8 row."""
    cache, md, q, stored = _batch(8, SPECS, [[] for _ in SPECS], num_prefills=2, seed=2)
    table = md.block_tables.clone()
    victims = [(0, 1), (2, 3), (2, 0)]  # (row, logical block)
    ids = [int(table[r, i]) for r, i in victims]
    before = reference.gather_kv(cache, torch.tensor(ids), torch.float32)
    others = [b for b in table.flatten().tolist() if b >= 0 and b not in ids]
    int8_before = reference.gather_kv(cache, torch.tensor(others), torch.float32)
    layers = [cache]  # (the runner's list: the store makes its int8 layer a HybridInt8KV in place)
    store = demote.DemotionStore(layers, num_slots=4)
    cache = layers[0]
    assert isinstance(cache, demote.HybridInt8KV)
    assert store.bytes_per_slot == demote.slot_bytes(H, BS, D) < bytes_per_block(8, H, BS, D, torch.float32)
    slots = store.take(len(ids))
    assert slots == [0, 1, 2] and store.num_free() == 1 and store.take(5) == [3] and store.take(1) == []
    store.release(3)
    store.demote(ids, slots)
    for (r, i), j in zip(victims, slots):
        table[r, i] = demote.code(j)
    cache.k[ids], cache.v[ids] = 7, -7  # the int8 blocks went back to the pool: a new owner wrote them
    after = reference.gather_kv(cache, torch.tensor([demote.code(j) for j in slots]), torch.float32)
    for x, y in zip(before, after):
        c, s, z = quant.quantize_int4(x)
        torch.testing.assert_close(y, quant.dequantize_int4(c, s, z, torch.float32), rtol=0, atol=0)
        assert ((y - x).norm() / x.norm()) < 0.15  # int4 error, not garbage
    for x, y in zip(int8_before, reference.gather_kv(cache, torch.tensor(others), torch.float32)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)  # int8 blocks untouched
    # attention over the mixed table (pool blocks, store slots, a hole) = explicit attention over what
    # each entry holds; holes are still masked, store entries are keys
    holes = [[], [], [2], []]
    table[2, 2] = -1
    md.block_tables = table
    mixed = [torch.stack(reference.gather_kv(cache, table[i][table[i] != -1], torch.float32))
             .transpose(2, 3).reshape(2, -1, H, D) for i in range(len(SPECS))]
    for i, h in enumerate(holes):  # the explicit oracle indexes keys by position: pad the holes back
        for b in h:
            mixed[i] = torch.cat([mixed[i][:, :b * BS], torch.zeros(2, BS, H, D), mixed[i][:, b * BS:]], dim=1)
    want, _ = _explicit(q, md, mixed, holes)
    torch.testing.assert_close(reference.paged_attention(q, cache, md, D ** -0.5), want, atol=1e-4, rtol=1e-4)
    # slots are released once, by code
    store.release_code(demote.code(slots[0]))
    with pytest.raises(NanoKVError):
        store.release(slots[0])
    with pytest.raises(NanoKVError):  # every layer must be int8: a block id leaves the pool in all of them
        demote.DemotionStore([cache, allocate_layer_cache(16, 4, H, BS, D, torch.float32, "cpu")], 4)


def test_probe_measures_the_attention_mass_per_block():
    cache, md, q, stored = _batch(16, SPECS, HOLES, num_prefills=2, seed=3)
    k_new = torch.cat([stored[i][0][md.seq_lens_cpu[i] - (md.query_start_loc_cpu[i + 1] - md.query_start_loc_cpu[i]):
                                    md.seq_lens_cpu[i]] for i in range(len(SPECS))])
    probe = AttentionProbe(query_chunk=4).begin(md)
    probe.record(0, cache, md, q, k_new)
    probe.record(1, cache, md, q, k_new)  # two layers: masses add up
    _, weights = _explicit(q, md, stored, HOLES)
    for (mx, sm), w, holes in zip(probe.take(), weights, HOLES):
        L = w.shape[-1]
        per_q = 2 * torch.nn.functional.pad(w.sum(0), (0, -L % BS)).reshape(w.shape[1], -1, BS).sum(-1)
        torch.testing.assert_close(sm, per_q.sum(0), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mx, per_q.max(0).values, atol=1e-5, rtol=1e-5)
        assert all(float(sm[h]) == 0.0 for h in holes)


@pytest.mark.parametrize("specs", [SPECS, [(40, 9), (63, 1), (30, 1)]], ids=["chunks", "one-token-prefill"])
def test_probe_without_decode_rows_scores_prefill_rows_alone(specs):
    """Under CUDA graphs (decode_rows=False) a decode row gets no score from an eager step, as from a
    graph step; the prefill rows' scores are the ones a full probe gives, also for a prefill whose
    chunk is one token (the second case: rows 0-1 are prefills, row 1's chunk is its last token)."""
    holes = HOLES[:1] + HOLES[2:] if len(specs) == 3 else HOLES
    cache, md, q, stored = _batch(16, specs, holes, num_prefills=2, seed=3)
    k_new = torch.cat([stored[i][0][md.seq_lens_cpu[i] - (md.query_start_loc_cpu[i + 1] - md.query_start_loc_cpu[i]):
                                    md.seq_lens_cpu[i]] for i in range(len(specs))])
    full = AttentionProbe(query_chunk=4).begin(md)
    part = AttentionProbe(query_chunk=4, decode_rows=False).begin(md)
    for p in (full, part):
        p.record(0, cache, md, q, k_new)
    qlens = [md.query_start_loc_cpu[i + 1] - md.query_start_loc_cpu[i] for i in range(len(specs))]
    assert qlens[-1] == 1  # the batch has both kinds of rows
    for i, (a, b) in enumerate(zip(full.take(), part.take())):
        assert a is not None
        if i >= md.num_prefills:
            assert b is None
        else:
            assert b is not None and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_probe_window_scores_the_last_queries_of_a_row():
    """probe_window=w: a row's mass is what the full probe gives its last w queries (the positions and
    the causal mask stay those of the whole row); decode rows are unchanged."""
    cache, md, q, stored = _batch(16, SPECS, HOLES, num_prefills=2, seed=3)
    k_new = torch.cat([stored[i][0][md.seq_lens_cpu[i] - (md.query_start_loc_cpu[i + 1] - md.query_start_loc_cpu[i]):
                                    md.seq_lens_cpu[i]] for i in range(len(SPECS))])
    w = 4
    full = AttentionProbe(query_chunk=3).begin(md)
    part = AttentionProbe(query_chunk=3, window=w).begin(md)
    for p in (full, part):
        p.record(0, cache, md, q, k_new)
    rows_full, rows_part = full._acc, part._acc
    for i in range(len(SPECS)):
        a, b = rows_full[i], rows_part[i]
        assert a is not None and b is not None
        assert b.shape[0] == min(w, a.shape[0])
        torch.testing.assert_close(b, a[-b.shape[0]:], atol=1e-6, rtol=1e-6)
    assert any(r.shape[0] > w for r in rows_full if r is not None)  # some row really was cut
    with pytest.raises(ConfigError):
        params_of(SimpleNamespace(compression_sparsity=0.5, sparsity_policy="attention",
                                  sparsity_options="probe_window=-1"))
