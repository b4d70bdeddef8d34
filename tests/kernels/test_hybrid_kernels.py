"""Hybrid sparsity on the Triton kernels (CPU: TRITON_INTERPRET=1, small shapes): one block table mixes
int8 pool blocks, INT4 demotion-store slots (-2 - j) and holes (-1); decode (one and several splits) and
prefill (chunks after a mixed context) equal the torch reference, which reads the same store; and an
engine with the Triton backend generates what the torch reference engine generates under hybrid."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs

pytest.importorskip("triton")

from nanokv.kernels import reference, triton_hybrid  # noqa: E402
from nanokv.kernels.triton_backend import TritonBackend  # noqa: E402
from nanokv.kv.cache import Int8KV, allocate_layer_cache  # noqa: E402
from nanokv.kv.demote import DemotedBlocks, HybridInt8KV, code  # noqa: E402
from nanokv.kv.metadata import AttentionMetadata  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 on a GPU: tl.dot runs TF32 (10-bit mantissa), as the engine's kernels do; the interpreter is exact
FP32_TOL = 1e-2 if DEV == "cuda" else 1e-4
BS, H, D = 8, 2, 32
POOL, SLOTS = 40, 12


def _cache(seed: int, bs: int = BS) -> HybridInt8KV:
    """An int8 layer with random contents in every pool block and every store slot (the slots hold
    blocks 20.. re-quantized, as a demotion writes them)."""
    g = torch.Generator().manual_seed(seed)
    c = allocate_layer_cache(8, POOL, H, bs, D, torch.float32, DEV, rotate=False)
    assert isinstance(c, Int8KV)
    slots = torch.arange(POOL * bs, device=DEV)
    kv = torch.randn(2, POOL * bs, H, D, generator=g).to(DEV)
    kv[:, : bs * 4] *= 3.0  # unequal magnitudes per block: scales differ
    reference.store_kvcache(kv[0], kv[1], c, slots)
    st = DemotedBlocks.zeros(SLOTS, c)
    st.write(c, torch.arange(20, 20 + SLOTS, device=DEV), torch.arange(SLOTS, device=DEV))
    return HybridInt8KV.of(c, st)


def _table(nb: int, kinds: str, g: torch.Generator) -> list[int]:
    """kinds: one letter per logical block, p = pool, s = store slot, h = hole."""
    pool = torch.randperm(20, generator=g).tolist()
    slot = torch.randperm(SLOTS, generator=g).tolist()
    return [pool.pop() if k == "p" else code(slot.pop()) if k == "s" else -1 for k in kinds[:nb]]


def _metadata(tables: list[list[int]], lens: list[int], qlens: list[int], num_prefills: int) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.int64, device=DEV),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV), block_tables=bt, num_prefills=num_prefills,
        num_prefill_tokens=qsl[num_prefills], num_decode_tokens=qsl[-1] - qsl[num_prefills],
        max_query_len=max(qlens), max_seq_len=max(lens), query_start_loc_cpu=qsl, seq_lens_cpu=lens)


# (context length, block kinds); the last block holds the new tokens: always a pool block
DECODES = [
    (37, "pshpp"),  # holes and a slot in the middle
    (8, "p"),  # one block
    (61, "sssssssp"),  # every full block demoted
    (40, "hhhhp"),  # every full block dropped
    (25, "hhhh"),  # all holes (not a state the engine makes): zero output, no NaN
    (33, "psphp"),
]


# hybrid_decode's kernels: the tile kernel, and the block kernel (triton_hybrid_block, per_block), also
# with its codes biased (block_bias; fp16 compute only). Block tiles are one block of >= 16 tokens: those
# cases run on 16-token blocks, lengths doubled (the same kinds per block, the same mid-block tails)
VARIANTS = {"tile": {}, "block": dict(per_block=True), "block_bias": dict(per_block=True, block_bias=True)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("G", [1, 3])
def test_decode_reads_pool_slots_and_holes(dtype, splits, G, variant):
    """fp32: byte tiles; fp16 and bf16 queries: fp16 compute, codes read as words (triton_hybrid_tile)
    or as byte tiles (the block kernel)."""
    g = torch.Generator().manual_seed(1)
    bs = 2 * BS if variant != "tile" else BS
    cache = _cache(0, bs)
    lens = [L * bs // BS for L, _ in DECODES]
    tables = [_table(-(-L // bs), kinds, g) for L, (_, kinds) in zip(lens, DECODES, strict=True)]
    md = _metadata(tables, lens, [1] * len(lens), 0)
    q = torch.randn(len(lens), H * G, D, generator=g).to(DEV, dtype)
    want = reference.paged_attention(q.float(), cache, md, D ** -0.5)
    got = torch.full_like(q, float("nan"))
    triton_hybrid.hybrid_decode(q, cache, md.block_tables, md.seq_lens, got, D ** -0.5, num_splits=splits, block_n=16,
                                **VARIANTS[variant])
    tol = FP32_TOL if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert got[4].abs().max() == 0  # the all-holes row
    # the same rows with the slots read as the int8 blocks they came from differ: the store is really read
    int8_tables = [[20 + (-2 - e) if e <= -2 else e for e in t] for t in tables]
    md8 = _metadata(int8_tables, lens, [1] * len(lens), 0)
    alt = reference.paged_attention(q.float(), cache, md8, D ** -0.5)
    assert (alt[2] - want[2]).abs().max() > 1e-2


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_tiles_of_several_blocks(dtype, variant):
    """32-token tiles over 8-token blocks: a tile mixes pool blocks, slots and holes (or is all one kind),
    tails end mid-tile, and the split boundaries fall inside the mixed stretch. The block kernel: 16-token
    tiles over 32-token blocks (two tiles a block, the entry read per tile), the same kinds."""
    g = torch.Generator().manual_seed(6)
    bs = 4 * BS if variant != "tile" else BS
    cache = _cache(7, bs)
    G = 2
    specs = [(100, "pshpsshhsppphp"), (64, "sssshhhp"), (72, "hhhhssssp"), (9, "sp"), (120, "phsphsphsphsphp")]
    lens = [L * bs // BS for L, _ in specs]
    tables = [_table(-(-L // bs), kinds, g) for L, (_, kinds) in zip(lens, specs, strict=True)]
    md = _metadata(tables, lens, [1] * len(lens), 0)
    q = torch.randn(len(lens), H * G, D, generator=g).to(DEV, dtype)
    want = reference.paged_attention(q.float(), cache, md, D ** -0.5)
    tol = FP32_TOL if dtype == torch.float32 else 2e-2
    for splits in (1, 2):
        got = torch.full_like(q, float("nan"))
        triton_hybrid.hybrid_decode(q, cache, md.block_tables, md.seq_lens, got, D ** -0.5, num_splits=splits,
                                    block_n=32, block_tile=16, **VARIANTS[variant])
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_block_kernel_refuses_tiles_it_cannot_read():
    """per_block tiles lie inside one block and feed the tensor cores: >= 16 tokens dividing the block size."""
    cache = _cache(0)  # 8-token blocks
    q = torch.zeros(1, H, D, device=DEV)
    lens = torch.tensor([8], dtype=torch.int32, device=DEV)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    for tile in (16, 12, 8):
        with pytest.raises(ValueError, match="block_tile"):
            triton_hybrid.hybrid_decode(q, cache, bt, lens, torch.empty_like(q), 1.0, per_block=True, block_tile=tile)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_chunks_after_a_mixed_context(dtype):
    g = torch.Generator().manual_seed(2)
    cache = _cache(3)
    G = 2
    # (context incl. the chunk, chunk length, kinds): chunks start mid-block and span several blocks
    specs = [(45, 13, "pshsp p"), (17, 17, "ppp"), (64, 20, "sshhpppp"), (29, 1, "hspp")]
    tables = [_table(-(-L // BS), kinds.replace(" ", "p"), g) for L, _, kinds in specs]
    md = _metadata(tables, [L for L, _, _ in specs], [n for _, n, _ in specs], len(specs))
    q = torch.randn(md.query_start_loc_cpu[-1], H * G, D, generator=g).to(DEV, dtype)
    want = reference.paged_attention(q.float(), cache, md, D ** -0.5)
    got = torch.full_like(q, float("nan"))
    triton_hybrid.hybrid_prefill(q, cache, md.block_tables, md.seq_lens, md.query_start_loc, md.max_query_len, got,
                                 D ** -0.5, block_m=16, block_n=16)
    tol = FP32_TOL if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_backend_mixed_step_matches_the_reference():
    """A step with prefills first, then decodes, through TritonBackend (the engine's entry point)."""
    g = torch.Generator().manual_seed(4)
    cache = _cache(5)
    G = 2
    specs = [(45, 13, "pshsp p"), (29, 1, "hspp"), (61, 1, "sssssssp"), (20, 1, "php")]
    tables = [_table(-(-L // BS), kinds.replace(" ", "p"), g) for L, _, kinds in specs]
    md = _metadata(tables, [L for L, _, _ in specs], [n for _, n, _ in specs], 2)
    q = torch.randn(md.query_start_loc_cpu[-1], H * G, D, generator=g).to(DEV)
    got = TritonBackend().paged_attention(q, cache, md, D ** -0.5)
    torch.testing.assert_close(got, reference.paged_attention(q, cache, md, D ** -0.5), atol=FP32_TOL, rtol=FP32_TOL)


def test_engine_hybrid_on_triton_generates_what_the_torch_reference_does():
    """A random-weight Qwen3 (GQA 6/2), hybrid@0.5 over int8: blocks are demoted and dropped during the
    chunked prefill, so the decodes read mixed tables; the Triton backend's greedy tokens equal the
    torch reference's (CPU, fp32; the real 30-layer model is too slow for the interpreter)."""
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    prompts = [[(7 * i + 3 + j) % 997 + 2 for i in range(n)] for j, n in enumerate((190, 120))]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs, demoted = {}, {}
    for backend in ("triton", "torch"):
        llm = LLM("random:tiny-qwen3", num_gpu_blocks=64, block_size=16, max_num_batched_tokens=128, device="cpu",
                  attention_backend=backend, enable_compression=True, quantization_bitwidth=8,
                  compression_sparsity=0.5, sparsity_policy="hybrid",
                  sparsity_options="sink_blocks=1,recent_blocks=2,min_ranked=0")
        assert llm.engine.runner.backend.name == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        sp = llm.engine.sparsity
        assert sp is not None
        demoted[backend] = sp.blocks_demoted
    assert demoted["triton"] == demoted["torch"] > 0
    assert outs["triton"] == outs["torch"] and all(len(o) == 4 for o in outs["torch"])
