"""Triton paged attention (decode, prefill, mixed) vs the torch reference (CPU: TRITON_INTERPRET=1).

The cache is filled with the reference store so these tests judge attention alone; the oracle is
the reference run in fp32 on the same cache contents.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
pytest.importorskip("triton")

from nanokv.kernels import reference, triton_decode  # noqa: E402
from nanokv.kernels.triton_backend import TritonBackend, choose_splits  # noqa: E402
from nanokv.kernels.triton_config import TritonConfig  # noqa: E402
from nanokv.kernels.triton_decode_swap import runs_transposed  # noqa: E402
from nanokv.kv.blockquant import quantize_filled  # noqa: E402
from nanokv.kv.cache import Int4KV, LayerKV, allocate_layer_cache  # noqa: E402
from nanokv.kv.metadata import AttentionMetadata  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [(16, torch.float32), (16, torch.float16), (8, torch.float16), (4, torch.float16),
           (8, torch.float32), (4, torch.float32)]


def build_batch(bits: int, dtype: torch.dtype, bs: int, H: int, G: int, D: int,
                prefills: list[tuple[int, int]], decodes: list[int], holes: bool, seed: int = 0,
                ) -> tuple[LayerKV, AttentionMetadata, torch.Tensor]:
    """prefills: (cached tokens, new tokens) each; decodes: context lengths (incl. the new token).
    Blocks are scattered at random; with holes, one block wholly before the first query position
    of each sequence becomes a -1 entry (the reference masks it the same way)."""
    g = torch.Generator().manual_seed(seed)
    specs = list(prefills) + [(L - 1, 1) for L in decodes]
    nbs = [-(-(c + n) // bs) for c, n in specs]
    nblk = sum(nbs) + 2
    cache = allocate_layer_cache(bits, nblk, H, bs, D, dtype, DEV)
    perm = torch.randperm(nblk, generator=g).tolist()
    tables = torch.full((len(specs), max(nbs) + 1), -1, dtype=torch.int32)  # +1: padded tables
    new_slots, new_kv = [], []
    for i, (c, n) in enumerate(specs):
        ids = [perm.pop() for _ in range(nbs[i])]
        tables[i, :nbs[i]] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(c + n)
        slots = torch.tensor(ids)[pos // bs] * bs + pos % bs
        kv = torch.randn(2, c + n, H, D, generator=g).to(dtype)
        fill(cache, kv[0, :c].to(DEV), kv[1, :c].to(DEV), slots[:c].to(DEV))
        new_kv.append((kv[0, c:], kv[1, c:]))
        new_slots.append(slots[c:])
        if holes and c // bs >= 1:
            tables[i, int(torch.randint(0, c // bs, (1,), generator=g))] = -1
    # this step's tokens, all sequences at once (int4: every block they touch is open, staged)
    step_k, step_v = (torch.cat(x).to(DEV) for x in zip(*new_kv))
    fill(cache, step_k, step_v, torch.cat(new_slots).to(DEV), last=True)
    qsl = [0]
    for _, n in specs:
        qsl.append(qsl[-1] + n)
    seq_lens = [c + n for c, n in specs]
    md = AttentionMetadata(
        slot_mapping=torch.cat(new_slots).to(DEV),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV), block_tables=tables.to(DEV),
        num_prefills=len(prefills), num_prefill_tokens=sum(n for _, n in prefills),
        num_decode_tokens=len(decodes), max_query_len=max(n for _, n in specs), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    q = torch.randn(qsl[-1], H * G, D, generator=g).to(dtype).to(DEV)
    return cache, md, q


def fill(cache: LayerKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, last: bool = False) -> None:
    """Store K/V [L, H, D] as the runner would have. int4: an earlier step (last=False) quantizes
    the blocks it filled and frees their staging; this step's tokens (last=True) stay staged."""
    if not isinstance(cache, Int4KV):
        reference.store_kvcache(k, v, cache, slots)
        return
    cache.stage.plan(slots.cpu().numpy())
    reference.store_kvcache(k, v, cache, slots)
    if not last:
        quantize_filled(cache)
        cache.stage.finish()


def step_kv(cache: LayerKV, md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's K/V as stored, [T, H, D] each, read back by slot (cache layout [N, H, bs, D])."""
    slots, bs = md.slot_mapping.long(), cache.block_size
    if isinstance(cache, Int4KV):  # int4: the step's blocks are open, read from staging
        st = cache.stage.stage_of[slots // bs].long()
        assert bool((st >= 0).all())
        return cache.k_stage[st, :, slots % bs], cache.v_stage[st, :, slots % bs]
    return cache.k[slots // bs, :, slots % bs], cache.v[slots // bs, :, slots % bs]


def check(cache: LayerKV, md: AttentionMetadata, q: torch.Tensor, cfg: TritonConfig,
          with_kv: bool = False) -> float:
    D = q.shape[-1]
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    k, v = step_kv(cache, md) if with_kv else (None, None)
    TritonBackend(cfg).paged_attention(q, cache, md, D ** -0.5, out=out, k=k, v=v)
    ref = reference.paged_attention(q.float(), cache, md, D ** -0.5)
    assert not out.isnan().any()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    tol = 1e-5 if q.dtype == torch.float32 and DEV == "cpu" else 2e-3
    assert err < tol, f"relative error {err:.2e}"
    return err


def check_twice_merged(cache: LayerKV, md: AttentionMetadata, q: torch.Tensor, cfg: TritonConfig) -> None:
    """check() twice: a kernel that merges its splits in place (merge_if_last) must leave its arrival
    counters at zero for the next launch."""
    for _ in range(2):
        check(cache, md, q, cfg)
        for counts in (buf for (kind, _), buf in triton_decode._BUFFERS.items() if kind == "counts"):
            assert int(counts.abs().sum()) == 0


def small_cfg(splits: int = 1, block_n: int = 16) -> TritonConfig:
    return TritonConfig(decode_block_n=block_n, quant_block_n=block_n, quant_swap_block_n=block_n,
                        decode_splits=splits,  # int8 tiles under 16 tokens: the untransposed kernel
                        prefill_block_m=16, prefill_block_n=block_n)


@pytest.mark.parametrize("bits,dtype", FORMATS)
@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("G", [1, 2, 3])
def test_decode(bits: int, dtype: torch.dtype, bs: int, G: int) -> None:
    cache, md, q = build_batch(bits, dtype, bs, 2, G, 32, [], [1, 9, 40, 70], holes=True, seed=bs + G)
    check(cache, md, q, small_cfg(splits=1 + (bs + G) % 3))


@pytest.mark.parametrize("splits", [1, 2, 5, 16])
@pytest.mark.parametrize("holes", [False, True])
def test_decode_split_k(splits: int, holes: bool) -> None:
    # 16 splits of a 5-token context: most splits are empty and must merge as zero weight
    cache, md, q = build_batch(16, torch.float32, 16, 2, 2, 32, [], [5, 33, 100, 150], holes, seed=splits)
    check(cache, md, q, small_cfg(splits=splits))


@pytest.mark.parametrize("bs,block_n", [(32, 16), (8, 64), (64, 32)])
def test_tile_vs_block_size(bs: int, block_n: int) -> None:
    """Tiles smaller than a block (part of one block) and larger (several blocks)."""
    cache, md, q = build_batch(8, torch.float32, bs, 2, 2, 32, [(40, 9)], [50, 130], holes=True, seed=bs)
    check(cache, md, q, small_cfg(splits=2, block_n=block_n))


# quantized decode tiles (bs, block_n, splits, warps, dtype): tiles of several blocks (int4: row
# groups, up to 16 blocks at bs 8), of part of a block, split-K incl. more splits than tiles, 1-4 warps
QUANT_TILES = [(8, 32, 1, 1, torch.float16), (16, 64, 2, 2, torch.float16), (16, 128, 5, 4, torch.float16),
               (32, 16, 3, 1, torch.float16), (8, 128, 16, 2, torch.float16), (16, 32, 4, 2, torch.float32)]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bs,block_n,splits,warps,dtype", QUANT_TILES)
@pytest.mark.parametrize("G", [1, 2, 3])
def test_quant_decode_tiles(bits: int, bs: int, block_n: int, splits: int, warps: int, dtype: torch.dtype,
                            G: int) -> None:
    cache, md, q = build_batch(bits, dtype, bs, 2, G, 32, [], [1, 9, 40, 70, 300], holes=True, seed=bs + G)
    cfg = small_cfg(splits=splits, block_n=block_n)
    cfg.quant_warps = warps
    check(cache, md, q, cfg)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("fold_k,fold_v", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("G", [2, 3])
def test_quant_decode_fold_off(bits: int, fold_k: bool, fold_v: bool, G: int) -> None:
    """The unfolded paths (the lead's A/B baselines) compute the same function."""
    cache, md, q = build_batch(bits, torch.float16, 16, 2, G, 32, [], [5, 40, 130], holes=True, seed=G)
    cfg = small_cfg(splits=2, block_n=64)
    cfg.quant_fold_k, cfg.quant_fold_v = fold_k, fold_v
    check(cache, md, q, cfg)


@pytest.mark.parametrize("bits", [8, 4])
def test_fold_v_peaked_softmax(bits: int) -> None:
    """Sharp attention puts most p * v_scale products in fp16's subnormal range: the folded PV must
    stay as close to the fp32 reference as per-element dequantization."""
    cache, md, q = build_batch(bits, torch.float16, 16, 2, 2, 32, [], [300, 200], holes=False, seed=3)
    q = q * 8  # scores ~ N(0, 64): weights spread over many orders of magnitude
    errs = {}
    for fold in (False, True):
        cfg = small_cfg(block_n=64)
        cfg.quant_fold_v = fold
        errs[fold] = check(cache, md, q, cfg)
    assert errs[True] < 1.5 * errs[False] + 1e-4, errs


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("tau,scale", [(1, 1.0), (8, 1.0), (8, 8.0)])
def test_quant_decode_lazy_rescale(bits: int, tau: int, scale: float) -> None:
    """Accumulators rescaled only when a running max grows by more than tau: the same function,
    with holes, split-K and sharp attention (scale 8: scores ~ N(0, 64), maxima keep growing)."""
    cache, md, q = build_batch(bits, torch.float16, 16, 2, 2, 32, [], [1, 9, 130, 300], holes=True, seed=tau)
    cfg = small_cfg(splits=2, block_n=32)
    cfg.quant_lazy_tau = tau
    check(cache, md, q * scale, cfg)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("min_rows,G,block_n", [(1, 2, 32), (1, 3, 16), (4, 2, 64), (8, 1, 32), (16, 2, 32)])
def test_quant_decode_fewer_padded_rows(bits: int, min_rows: int, G: int, block_n: int) -> None:
    """Query rows padded to fewer than 16 (Triton pads inside the MMA) or to 16: the same function."""
    cache, md, q = build_batch(bits, torch.float16, 16, 2, G, 32, [], [1, 9, 130, 300], holes=True, seed=G)
    cfg = small_cfg(splits=2, block_n=block_n)
    cfg.quant_min_rows = min_rows
    check(cache, md, q, cfg)


@pytest.mark.parametrize("kernel,bs", [("fold", 8), ("fold", 16), ("generic", 8), ("generic", 16), ("swap4", 16),
                                       ("swap4", 32)])
def test_int4_decode_staged_before_newest_block(kernel: str, bs: int) -> None:
    """In a runner decode step only a sequence's newest block is open; a block staged anywhere else
    (here: a full block re-staged with new contents) must still be read from staging, by each int4
    decode kernel (folded, generic, transposed)."""
    cache, md, q = build_batch(4, torch.float16, bs, 2, 2, 32, [], [70, 100], holes=False, seed=bs)
    assert isinstance(cache, Int4KV)
    blk = int(md.block_tables[1, 2])  # a full block of sequence 1, before its newest
    rows = blk * bs + torch.arange(bs)
    cache.stage.plan(rows.numpy())
    k, v = (torch.randn(2, bs, 2, 32).to(torch.float16) * 3).to(DEV)
    reference.store_kvcache(k, v, cache, rows.to(DEV))  # into staging: the pool keeps the old codes
    cfg = small_cfg(splits=2, block_n=16 if kernel == "swap4" else 32)
    cfg.quant_fold_k = kernel != "generic"
    cfg.quant_swap4 = kernel == "swap4"
    check(cache, md, q, cfg)


@pytest.mark.parametrize("bits,dtype", FORMATS)
@pytest.mark.parametrize("bs", [8, 16, 32])
def test_prefill_with_prefix_hits(bits: int, dtype: torch.dtype, bs: int) -> None:
    # fresh prompt, partial prefix hit, chunk starting mid-block, single-token prefill
    prefills = [(0, 21), (2 * bs, 13), (bs + 3, 30), (37, 1)]
    cache, md, q = build_batch(bits, dtype, bs, 2, 2, 32, prefills, [], holes=True, seed=bs)
    check(cache, md, q, small_cfg())


@pytest.mark.parametrize("bs,block_n", [(8, 32), (16, 16), (32, 64), (16, 64)])
@pytest.mark.parametrize("kinds", [False, True])
def test_int4_prefill_tile_kinds(bs: int, block_n: int, kinds: bool) -> None:
    """int4 prefill in runs of code-only, boundary and staging-only tiles (prefill_tile_kinds) or
    every tile looking both up: the first open block at various offsets in a tile, holes, a fresh
    prompt, a chunk starting on a block boundary."""
    prefills = [(3 * bs + 5, 40), (2 * block_n, 17), (block_n + bs, 9), (bs - 1, 30), (0, 12), (2 * bs, 70)]
    cache, md, q = build_batch(4, torch.float16, bs, 2, 2, 32, prefills, [], holes=True, seed=bs + block_n)
    cfg = small_cfg(block_n=block_n)
    cfg.prefill_tile_kinds = kinds
    check(cache, md, q, cfg)


@pytest.mark.parametrize("G", [1, 2, 3])
def test_mixed_prefill_and_decode(G: int) -> None:
    cache, md, q = build_batch(16, torch.float16, 16, 2, G, 64, [(0, 17), (40, 6)], [3, 64, 90],
                               holes=True, seed=G)
    check(cache, md, q, small_cfg(splits=3))


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_mixed_quantized_default_config(bits: int) -> None:
    """Default (GPU) tile sizes and the automatic split choice."""
    cache, md, q = build_batch(bits, torch.float32, 16, 2, 2, 32, [(20, 12)], [300, 600], holes=True)
    check(cache, md, q, TritonConfig(min_split_tokens=64))


def test_noncontiguous_query_and_all_hole_context() -> None:
    cache, md, q = build_batch(16, torch.float32, 8, 2, 2, 32, [], [20, 30], holes=False)
    qkv = torch.randn(q.shape[0], 3 * q.shape[1], q.shape[2], device=DEV)
    q = qkv[:, : q.shape[1]]  # a view with row stride 3 * Hq * D
    check(cache, md, q, small_cfg(splits=2))
    # every block of sequence 0 dropped: the kernel returns zeros (the reference would give NaN)
    md.block_tables[0] = -1
    out = TritonBackend(small_cfg(splits=2)).paged_attention(q, cache, md, 0.2)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("min_tokens", [1, 0])
@pytest.mark.parametrize("bits", [16, 8, 4])
def test_fresh_prompts_sdpa_route(dtype: torch.dtype, min_tokens: int, bits: int) -> None:
    """Batches of fresh prompts (no cached prefix) may go to torch SDPA: same function either way
    (int4: the prompt's own blocks are still staged in full precision; int8: SDPA attends to the
    codes read back from the cache, as the paged kernel does)."""
    cache, md, q = build_batch(bits, dtype, 8, 2, 2, 32, [(0, 21), (0, 9), (0, 40)], [], holes=False)
    cfg = small_cfg()
    cfg.sdpa_prefill_min_tokens = min_tokens
    assert bool(TritonBackend(cfg)._fresh(cache, md, step_kv(cache, md)[0])) == (min_tokens > 0)
    check(cache, md, q, cfg, with_kv=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fresh_prompts_through_sdpa_mixed_with_cached_prefixes(dtype: torch.dtype) -> None:
    """Fresh prompts read this step's K/V directly (SDPA); a continuing chunk and a prefix hit
    between them go to the paged kernel in runs; decodes after. All must match the reference."""
    bs = 8
    prefills = [(0, 21), (16, 9), (5, 12), (0, 30), (0, 3)]
    cache, md, q = build_batch(16, dtype, bs, 2, 2, 32, prefills, [7, 40], holes=False, seed=11)
    be = TritonBackend(TritonConfig(decode_block_n=16, prefill_block_m=16, prefill_block_n=16,
                                    sdpa_prefill_min_tokens=1))
    assert be._fresh(cache, md, step_kv(cache, md)[0]) == [0, 3, 4]
    check(cache, md, q, be.config, with_kv=True)


@pytest.mark.parametrize("G,bs,swap_n,splits,merge", [(2, 16, 16, 1, True), (2, 32, 16, 3, True),
                                                      (2, 32, 16, 3, False), (3, 64, 32, 2, True),
                                                      (1, 32, 32, 1, True), (2, 16, 32, 2, True),
                                                      (2, 16, 0, 2, True), (1, 16, 16, 9, True)])
def test_int8_decode_swap_ab(G: int, bs: int, swap_n: int, splits: int, merge: bool) -> None:
    """Transposed products (tokens on the MMA's M side, triton_decode_swap; tiles of one block or
    part of one) and the untransposed int8 kernel (swap_n 0, or tiles larger than a block): the
    reference's function, with holes, split-K (merged in the kernel or by the reduce launch; 9
    splits: empty ones, and a split count that is not a power of two) and a context of one token.
    Twice: the in-kernel merge must leave its arrival counters at zero for the next launch."""
    assert runs_transposed(8, swap_n, True, bs) == (0 < swap_n <= bs)
    cache, md, q = build_batch(8, torch.float16, bs, 2, G, 32, [], [1, 40, 130, 301], holes=True, seed=G)
    cfg = small_cfg(splits=splits, block_n=32)
    cfg.quant_swap_block_n = swap_n
    cfg.quant_swap_merge = merge
    check_twice_merged(cache, md, q, cfg)


def test_split_counts_by_format_and_batch() -> None:
    """choose_splits: the transposed int8 kernel gets >= 8 splits, more (a power of two) when the batch
    leaves the GPU short of ~16 programs per SM, capped by the context (256 tokens per split); 16-bit
    aims at 3 programs per SM; an explicit decode_splits wins."""
    cfg = TritonConfig()
    got = {B: choose_splits(cfg, B, 8, 4096, 132, 8, 16) for B in (1, 4, 16, 24, 32, 64, 128, 256)}
    assert got == {1: 16, 4: 16, 16: 16, 24: 8, 32: 8, 64: 8, 128: 8, 256: 8}
    assert choose_splits(cfg, 16, 8, 1024, 132, 8, 16) == 4  # a short context: 256 tokens per split
    assert [choose_splits(cfg, B, 8, 4096, 132) for B in (1, 16, 64, 128)] == [16, 4, 1, 1]
    assert choose_splits(cfg, 128, 8, 4096, 132, 8, 8) == cfg.quant_min_splits  # tiles of 16 > 8-token blocks
    assert choose_splits(TritonConfig(decode_splits=3), 128, 8, 4096, 132, 8, 16) == 3
    # int4 (the CUDA kernel): the power of two nearest to quant_cuda4_waves (2) waves of 16 programs
    # per SM, at least 8, capped by the context
    got = {B: choose_splits(cfg, B, 8, 8192, 132, 4, 16) for B in (16, 32, 64, 96, 128, 256)}
    assert got == {16: 32, 32: 16, 64: 8, 96: 8, 128: 8, 256: 8}
    four = TritonConfig(quant_cuda4_waves=4)
    got = {B: choose_splits(four, B, 8, 8192, 132, 4, 16) for B in (16, 32, 64, 96, 128, 256)}
    assert got == {16: 32, 32: 32, 64: 16, 96: 8, 128: 8, 256: 8}
    assert choose_splits(TritonConfig(quant_cuda4_waves=0), 64, 8, 8192, 132, 4, 16) == 8  # the Triton rule


@pytest.mark.parametrize("G,bs,swap_n,splits,prefetch", [(2, 16, 16, 1, 0), (2, 32, 16, 3, 2), (3, 32, 32, 2, 1),
                                                         (1, 16, 16, 9, 2), (2, 64, 16, 2, 0)])
def test_int4_decode_swap(G: int, bs: int, swap_n: int, splits: int, prefetch: int) -> None:
    """The transposed int4 kernel (triton_decode_swap4: one block's key scales folded into the query
    per tile, open blocks from staging in a second loop) against the reference: holes, split-K with
    empty splits, a one-token context, tiles of a whole block or part of one, metadata loaded in the
    tile or a tile ahead. Twice: the in-kernel merge must leave its counters at zero."""
    cache, md, q = build_batch(4, torch.float16, bs, 2, G, 32, [], [1, 40, 130, 301], holes=True, seed=G + bs)
    cfg = small_cfg(splits=splits, block_n=32)
    cfg.quant_swap_block_n = swap_n
    cfg.quant_swap4 = True
    cfg.quant_swap4_prefetch = prefetch
    assert runs_transposed(4, swap_n, True, bs, int4=True) and not runs_transposed(4, swap_n, True, bs)
    check_twice_merged(cache, md, q, cfg)
