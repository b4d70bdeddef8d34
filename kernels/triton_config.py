"""TritonConfig: the Triton backend's tile shapes and launch options, each default with the reason
for it, and the overrides (EngineConfig.kernel_options) whole benchmarks A/B them with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class TritonConfig:
    """Tile shapes and launch options. Decode defaults are the fastest measured on an H200 at
    Qwen3-0.6B shapes; quant_* apply to int8/int4 caches. The comments say what each default chooses
    and why; the measurements behind them (command, machine, date) are in docs/kernels.md, "The
    measurements behind TritonConfig"."""
    decode_block_n: int = 64  # tokens per K/V tile (any multiple or fraction of the block size)
    decode_warps: int = 8
    decode_stages: int = 2
    # int8/int4 decode: small one-warp programs, at least quant_min_splits per sequence: more programs
    # in flight hide the latency of the in-register code expansion better than wider tiles
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
    # registers per thread for int8/int4 decode, 0 = the compiler's choice (an A/B knob: a cap fits
    # more programs per SM, without spills at these shapes)
    quant_maxnreg: int = 0
    # int8/int4 decode: rescale the accumulators only when a row's running max grows by more than
    # this (base-2 exponent; 0 = after every tile). Saves the [16, D] fp32 rescale of the padded rows.
    # Untransposed kernels only (triton_decode_swap has no padded rows to save). Off: no measurable gain
    quant_lazy_tau: int = 0
    # int8/int4 decode: query rows of a KV group padded to at least this many (16 = a whole MMA
    # tile; smaller lets Triton pad inside the instruction, with fewer accumulator registers).
    # 0 = by format: int4 1 (faster with fewer registers), int8 16 (1 row was slower)
    quant_min_rows: int = 0
    # int8 decode with both products transposed (triton_decode_swap: query heads on the MMA's N side):
    # tokens per tile, >= 16 and dividing block_size, 0 = off (the kernel above). 16, the smallest
    # tile the PV product allows, is the fastest; wider tiles were slower
    quant_swap_block_n: int = 16
    # its fewest splits per sequence: 8 fills the H200's last wave of programs better at the
    # long-context decode batch, and costs little elsewhere
    quant_swap_min_splits: int = 8
    # its register cap (ptxas .maxnreg; 0 = none). With the scales loaded a tile ahead it compiles to
    # 99 registers, 19 one-warp programs per SM; 96 fits 20
    quant_swap_maxnreg: int = 96
    # its pipeline depth (0 = quant_stages): 3 is faster at small and at long-context batches, within
    # 1% elsewhere
    quant_swap_stages: int = 3
    # its splits merged inside the kernel by the last program of each (sequence, KV head), not by a
    # second launch (merge_if_last)
    quant_swap_merge: bool = True
    # its split-K target: about this many programs per SM (~20 of its one-warp programs fit at once),
    # the split count rounded down to a power of two; small batches need the extra splits
    quant_swap_programs_per_sm: int = 16
    # int4 decode through the transposed kernel too (triton_decode_swap4: one block's key scales folded
    # into the query per tile, codes as uint8 tiles), with the quant_swap_* tiles, splits and merge;
    # much faster than triton_decode_int4
    quant_swap4: bool = True
    # its register cap (0 = none): at 128, 16 one-warp programs per SM fit; uncapped it takes 152
    # registers and is slower, and other caps measured slower too
    quant_swap4_maxnreg: int = 128
    # what it loads a tile ahead: 0 nothing, 1 the block-table entry and staging slot (the head of each
    # tile's chain of dependent loads), 2 the scales and zeros too. 1 is the fastest, per call and
    # over whole runs
    quant_swap4_prefetch: int = 1
    # int4 decode through the CUDA C++ kernel (cuda_decode_int4: MMA fragments placed by hand) where it
    # applies (head dim 128, contiguous caches, a GPU whose torch has NVRTC), else the kernels above.
    # The same function as triton_decode_swap4, faster
    quant_cuda4: bool = True
    # its register cap (0 = the compiler's choice: caps were slower, with more recomputed addresses)
    # and the depth of its copy ring: registers, not shared memory, cap its programs per SM, so a
    # deeper ring does not pay and 2 stages is the fastest
    quant_cuda4_maxnreg: int = 0
    quant_cuda4_stages: int = 2
    # 16-token tiles per step of its loop where the block size allows (bs % (16 n) == 0, else fewer):
    # the tiles of a step share the block's q * scale products and bias q . z, the softmax reductions
    # and the step's copy bookkeeping (fewer executed instructions per 16 tokens). 2 is the fastest;
    # 4 tiles (64-token blocks) spill
    quant_cuda4_tiles: int = 2
    # decode-only steps: the CUDA kernel also quantizes the blocks the step's tokens complete
    # (cuda/fill_int4.cuh, each block shared by its row's split programs), instead of the fill kernel's
    # launch per layer after attention: a few microseconds inside the launch saves a launch
    quant_cuda4_fill: bool = True
    # its programs ordered by sequence length, longest first (one argsort per step, shared by the
    # layers): over uneven lengths fewer SMs idle at the end of the launch
    quant_cuda4_by_length: bool = True
    # its split count: the power of two nearest to this many waves of 16 one-warp programs per SM, at
    # least quant_swap_min_splits; 0 = the Triton kernel's rule. 2 halves the splits below ~93
    # sequences (fewer partials to merge), and whole runs are slightly faster than at 4
    quant_cuda4_waves: int = 2
    # launch it through cuda_decode_int4._Launcher (argument array built once), not torch's launcher
    # (a ctypes object, cast and array type per argument and call): less host time in eager steps
    quant_cuda4_direct_launch: bool = True
    # int8/int4 layers: the model's q/k norm + RoPE kernel (triton_rope) also applies the format's q/k
    # rotation, instead of a separate GEMM per layer and step (nanokv.compute_service.kv_hooks.fused_rotation):
    # the GEMM and its host work saved, at no measurable cost
    qk_rotation_in_rope: bool = True
    # that kernel's tokens per program in steps of 1024 tokens or more when it rotates (else one)
    rope_tokens: int = 4
    # int4 fill kernel (triton_blockquant): codes by the scale's reciprocal with two exact corrections
    # (div_by_recip, the same codes) instead of the IEEE division, whose slow path a warp takes when
    # any lane needs it (every channel's minimum: a zero dividend). A prefill step's fill then runs
    # fastest at one warp per program (prefill_fill_warps)
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
    # the one tile at the first open block, staging only) instead of every tile looking both up
    prefill_tile_kinds: bool = True
    # int4 caches: prefill rows / warps per program (0 = prefill_*): 128 / 8 is faster than the
    # 16-bit kernel's 64 / 4 at every split of cached and new tokens measured
    quant4_prefill_block_m: int = 128
    quant4_prefill_warps: int = 8
    # fresh prompts (no cached prefix) in a 16-bit cache go to torch SDPA (flash), much faster than
    # the paged prefill kernel, once the longest is at least this long; 0 = never
    sdpa_prefill_min_tokens: int = 256
    # those prompts in fp16 (the quantized caches' compute dtype) through cuDNN's attention, one prompt
    # per call, instead of one varlen flash call: faster per fp16 call, but whole runs gained nothing
    # (and bf16 is slower through it): off
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
