"""TritonConfig: the Triton backend's tile shapes and launch options, each default with the
measurement behind it, and the overrides (EngineConfig.kernel_options) whole benchmarks A/B them with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class TritonConfig:
    """Tile shapes and launch options. Decode defaults are the fastest measured on an H200 at
    Qwen3-0.6B shapes (docs/kernels.md); quant_* apply to int8/int4 caches."""
    decode_block_n: int = 64  # tokens per K/V tile (any multiple or fraction of the block size)
    decode_warps: int = 8
    decode_stages: int = 2
    # int8/int4 decode: small one-warp programs, at least quant_min_splits per sequence. Fastest of a
    # 30-point sweep on the H200 at both bench shapes (docs/kernels.md, 2026-12-01): more programs in
    # flight hide the latency of the in-register code expansion better than wider tiles
    quant_block_n: int = 32
    quant_warps: int = 1
    quant_stages: int = 2
    quant_min_splits: int = 4
    # int4 decode: the per-block channel scales of the keys folded into the query, several blocks
    # per tile in row groups (triton_decode_int4); False = per-element dequantization of key tiles
    quant_fold_k: bool = True
    # int8/int4 decode: per-token V scales folded into the softmax weights (p * vs) @ codes instead
    # of dequantizing each V element (int4: only with quant_fold_k)
    quant_fold_v: bool = True
    # registers per thread for int8/int4 decode, 0 = the compiler's choice (sm_90, 4 warps, Triton 3.6,
    # offline, no spills when capped: folded int4 at block_n 128 takes 222 = 2 programs per SM, 168
    # fits 3; int8 at block_n 64 takes 110 = 4 per SM, 96 fits 5)
    quant_maxnreg: int = 0
    # int8/int4 decode: rescale the accumulators only when a row's running max grows by more than
    # this (base-2 exponent; 0 = after every tile). Saves the [16, D] fp32 rescale of the padded rows.
    # Untransposed kernels only (triton_decode_swap has no padded rows to save; tried there, within
    # 2.5% either way, H200, 2026-12-01)
    quant_lazy_tau: int = 0
    # int8/int4 decode: query rows of a KV group padded to at least this many (16 = a whole MMA
    # tile; smaller lets Triton pad inside the instruction, with fewer accumulator registers).
    # 0 = by format, as measured on the H200 (2026-12-01): int4 1 (14-15% faster
    # than 16 at both probe shapes), int8 16 (1 was 9% slower at 64 x 4096, equal on ragged lengths)
    quant_min_rows: int = 0
    # int8 decode with both products transposed (triton_decode_swap: query heads on the MMA's N side):
    # tokens per tile, >= 16 and dividing block_size, 0 = off (the kernel above). At 16: 162.6 us vs
    # 215.0 at 64 x 4096, 178.8 vs 217.1 at 256 x 1024, 146.5 vs 186.4 engine-like (H200, 2026-12-01);
    # 32- and 64-token tiles were slower (2026-12-02, 32-token blocks: 240.6 vs 218.3 us at 16-token
    # blocks and tiles). (An int4 counterpart, one block per tile, was slower than triton_decode_int4.)
    quant_swap_block_n: int = 16
    # its fewest splits per sequence: 8 fills the H200's last wave of programs better at the long-context
    # decode batch (B 128, lengths over [2048, 4096]: 251.0 vs 277.3 us at 4; with the scales a tile ahead: 226.7
    # vs 236.0, 228.2 at 16), within 3% elsewhere
    quant_swap_min_splits: int = 8
    # its register cap (ptxas .maxnreg; 0 = none). With the scales loaded a tile ahead it compiles to 99
    # registers, 19 one-warp programs per SM; 96 gives 20: 221.2 vs 233.6 us at the long-context decode
    # batch (H200, 2026-12-02)
    quant_swap_maxnreg: int = 96
    # its pipeline depth (0 = quant_stages). 3: 212.8 / 215.6 vs 213.9 / 217.3 us at the long-context
    # decode batch (two calls), 113.7 vs 114.9 at 64 sequences, 38.9 vs 44.2 at 16 (engine-like
    # lengths; 60.9 vs 60.3 at 32, 143.3 vs 142.7 at 64 x 4096; H200, 2026-12-02)
    quant_swap_stages: int = 3
    # its splits merged inside the kernel by the last program of each (sequence, KV head), not by a
    # second launch (merge_if_last)
    quant_swap_merge: bool = True
    # its split-K target: about this many programs per SM (~20 of its one-warp programs fit at once),
    # the split count rounded down to a power of two. Engine-like lengths up to 4096 (H200, 2026-12-02):
    # 16 sequences 35.8 us at 16 splits vs 44.2 at 8; 32 sequences 60.3 at 8 vs 70.8 at 11, 65.2 at 16
    quant_swap_programs_per_sm: int = 16
    # int4 decode through the transposed kernel too (triton_decode_swap4: one block's key scales folded
    # into the query per tile, codes as uint8 tiles), with the quant_swap_* tiles, splits and merge.
    # Long-context decode batch (B 128, lengths over [2048, 4096], 16-token blocks; H200, 2026-12-02):
    # 188.1 us vs 286.1 for triton_decode_int4
    quant_swap4: bool = True
    # its register cap (0 = none): at 128, 16 one-warp programs per SM fit (same batch, no tile-ahead
    # loads: 203.6-205.2 us; uncapped it takes 152 registers, 238.3 us; 112 / 120 / 136 / 144: 228.8 /
    # 218.7 / 231.8 / 223.8 us)
    quant_swap4_maxnreg: int = 128
    # what it loads a tile ahead: 0 nothing, 1 the block-table entry and staging slot (the head of each
    # tile's chain of dependent loads), 2 the scales and zeros too. Same batch at 128 registers: 203.6 /
    # 188.1 / 202.6 us; whole long-context int4 run 10,392 / 10,364 (0) vs 10,916 tok/s (1)
    quant_swap4_prefetch: int = 1
    # int4 decode through the CUDA C++ kernel (cuda_decode_int4: MMA fragments placed by hand) where it
    # applies (head dim 128, contiguous caches, a GPU whose torch has NVRTC), else the kernels above.
    # Long-context decode batch (B 128, lengths over [2048, 4096], 16-token blocks; H200, 2026-12-02):
    # 168.2 us vs 188.9 for triton_decode_swap4, the same function (relative difference 1.8e-4)
    quant_cuda4: bool = True
    # its register cap (0 = the compiler's choice, 128; 96: 184.1 us, no spills but more recomputed
    # addresses) and the depth of its copy ring (2 / 3 / 4 stages: 168.2 / 170.8 / 173.3 us)
    # (2026-12-03, 32-token blocks, whole-sector copies: 2 stages 142.2 us, 3 stages 143.7; caps of
    # 128 / 112 / 104 registers with all shared memory to the kernel 149.4 / 151.9 / 156.7 vs 142.5)
    # (2026-12-03: 2 / 3 / 4 stages 144.3 / 145.9 / 149.8 us at 12 / 12 / 11 programs per SM, the
    # driver's occupancy figure; with the preferred shared-memory carveout at 100%: the same 144.3 /
    # 146.3 / 149.8: registers, not shared memory, cap the programs per SM, and a deeper ring does not pay)
    quant_cuda4_maxnreg: int = 0
    quant_cuda4_stages: int = 2
    # 16-token tiles per step of its loop where the block size allows (bs % (16 n) == 0, else fewer):
    # the tiles of a step share the block's q * scale products and bias q . z, the softmax reductions
    # and the step's copy bookkeeping (sm_90 SASS of the loop: 443 executed instructions per 16
    # tokens with 1 tile, 330 with 2, at 167 registers, 12 programs per SM). H200, B 128, lengths over
    # [2048, 4096], 32-token blocks (2026-12-03): 2 tiles 166.3 us vs 1 tile 198.5 (16-token blocks,
    # 1 tile: 165.8); 2 tiles capped at 128 registers 173.1; 64-token blocks, 4 tiles 303.5 vs 2 255.1.
    # With whole-sector copies: 2 tiles 142.2 us vs 1 tile 176.0
    quant_cuda4_tiles: int = 2
    # decode-only steps: the CUDA kernel also quantizes the blocks the step's tokens complete
    # (cuda/fill_int4.cuh, each block shared by its row's split programs), instead of the fill kernel's
    # launch per layer after attention. Cost inside the launch (H200, 2026-12-03, B 128): 16 / 32 / 64-token
    # blocks 3.3 / 3.5 / 8.9 us (one warp per block, before: 4.9 / 18.7 / 95.0)
    quant_cuda4_fill: bool = True
    # its programs ordered by sequence length, longest first (one argsort per step, shared by the
    # layers): over uneven lengths fewer SMs idle at the end of the launch
    quant_cuda4_by_length: bool = True
    # its split count: the power of two nearest to this many waves of 16 one-warp programs per SM (the
    # 2-tile loop fits 12: 3 waves measured the same, 165.5 vs 166.7 us), at least
    # quant_swap_min_splits; 0 = the Triton kernel's rule. H200, lengths over [2048, 4096], 2026-12-02:
    # B 64: 16 splits 100.9 / 101.8 us vs 8 109.0 / 109.6; B 96: 8 splits 126.0 vs 11 132.0; B 128: 8
    # splits 164.3 vs 12 169.7, 16 179.6; 2026-12-03, 32-token blocks: 4 / 3 / 2 waves 142.2 / 142.3 / 142.0.
    # 2 halves the splits below ~93 sequences (B 64: 8 instead of 16; the floor keeps 8 at 128). H200,
    # 2026-12-03: B 64 86.2 vs 87.9 us, B 32 and 128 the same; whole long-context int4 runs
    # alternating in one call, six each: 15,133-15,149 tok/s against 15,020-15,057 at 4
    quant_cuda4_waves: int = 2
    # launch it through cuda_decode_int4._Launcher (argument array built once), not torch's launcher
    # (a ctypes object, cast and array type per argument and call): host time in eager steps. H200,
    # 25 long-context prefill steps under cProfile (2026-12-03): 0.071 vs 0.174 s for 672 launches
    quant_cuda4_direct_launch: bool = True
    # int8/int4 layers: the model's q/k norm + RoPE kernel (triton_rope) also applies the format's q/k
    # rotation, instead of a separate GEMM per layer and step (nanokv.compute_service.kv_hooks.fused_rotation).
    # H200 long-context int8 run, 2026-12-02: 11,130 tok/s with it vs 10,827 without (one pair)
    qk_rotation_in_rope: bool = True
    # that kernel's tokens per program in steps of 1024 tokens or more when it rotates (else one)
    rope_tokens: int = 4
    # int4 fill kernel (triton_blockquant): codes by the scale's reciprocal with two exact corrections
    # (div_by_recip, the same codes) instead of the IEEE division, whose slow path a warp takes when
    # any lane needs it (every channel's minimum: a zero dividend). A prefill step's fill then runs
    # one warp per program (prefill_fill_warps). H200, 512 blocks x 8 heads, 32-token blocks
    # (2026-12-03, prefill_probe --fill): 1 / 2 / 4 / 8 warps 88.1 / 100.6 / 146.7 / 150.4 us, against the
    # division's 161.3 / 168.8 / 156.2 / 141.2 (8 warps was its choice)
    fill_recip: bool = True
    decode_splits: int = 0  # 0 = choose from the grid size and SM count; >= 1 forces it
    programs_per_sm: int = 3  # split-K target: about this many decode programs per SM
    min_split_tokens: int = 256  # no split shorter than this (the merge would cost more than it saves)
    max_splits: int = 64
    prefill_block_m: int = 64  # (token, head) rows per program
    prefill_block_n: int = 64
    prefill_warps: int = 4
    prefill_stages: int = 2
    # int4 caches: the prefill's context in runs of tiles compiled for what they read (codes only,
    # the one tile at the first open block, staging only) instead of every tile looking both up.
    # H200 (prefill_probe, three chunks at 64 rows / 4 warps): 1,379 vs 2,024 us
    prefill_tile_kinds: bool = True
    # int4 caches: prefill rows / warps per program (0 = prefill_*). H200, Qwen3 shapes, one chunk
    # of L new on C cached tokens (2048:2048, 3072:1024, 1024:3072; nanokv_tools.bench.prefill_probe):
    # 64 rows / 4 warps 499.6 / 291.4 / 588.2 us, 128 / 8 479.6 / 262.6 / 568.2 (every tile
    # looking staging up, before prefill_tile_kinds: 735.9 / 386.5 / 901.1; bf16 804 us in all)
    quant4_prefill_block_m: int = 128
    quant4_prefill_warps: int = 8
    # fresh prompts (no cached prefix) in a 16-bit cache go to torch SDPA (flash), 2.5x faster than
    # the paged prefill kernel on an H200, once the longest is at least this long; 0 = never
    sdpa_prefill_min_tokens: int = 256
    # those prompts in fp16 (the quantized caches' compute dtype) through cuDNN's attention, one prompt
    # per call, instead of one varlen flash call. H200, a 16,384-token step of 5 prompts, 16 / 8
    # heads, dim 128 (nanokv_tools.bench.attn_probe, 2026-12-03): 668.4 vs 796.5 us in fp16; bf16 925.5 vs
    # 795.5 (so bf16 keeps flash). Whole long-context int4 runs (2026-12-03, one machine): 14,937 tok/s
    # with it against 15,022 without (within the run-to-run spread; no gain): off
    fresh_prefill_cudnn: bool = False
    asm: bool | None = None  # inline-PTX code expansion (None: on NVIDIA GPUs)
    words: bool | None = None  # read quantized codes as int32 words (None: when the head dim allows)


def apply_overrides(cfg: TritonConfig, spec: str) -> TritonConfig:
    """"quant_fold_v=0,quant_block_n=64" -> cfg with those bool / int fields set (an unknown name is
    an error naming the allowed fields)."""
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, val = item.partition("=")
        cur = getattr(cfg, name, None) if name in TritonConfig.__dataclass_fields__ else None
        if not isinstance(cur, (bool, int)):
            ok = [f for f, v in vars(TritonConfig()).items() if isinstance(v, (bool, int))]
            raise ValueError(f"unknown kernel option {name!r}; allowed: {', '.join(ok)}")
        setattr(cfg, name, val.lower() in ("1", "true", "yes") if isinstance(cur, bool) else int(val))
    return cfg


_OVERRIDES = ""  # this process's EngineConfig.kernel_options (set_overrides)


def set_overrides(spec: str) -> None:
    """Make `spec` ("quant_fold_v=0,quant_block_n=64") the overrides every later default_config()
    applies: EngineConfig.kernel_options, set by the runner before it builds a backend. ValueError
    names an unknown field."""
    global _OVERRIDES
    spec = (spec or "").strip()
    apply_overrides(TritonConfig(), spec)
    if spec:
        log.info("Triton kernel options: %s", spec)
    _OVERRIDES = spec


def overrides() -> str:
    return _OVERRIDES


def default_config() -> TritonConfig:
    """The defaults with this process's kernel options applied."""
    return apply_overrides(TritonConfig(), _OVERRIDES)
