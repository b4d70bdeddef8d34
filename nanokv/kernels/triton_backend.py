"""TritonBackend: the attention backend interface on the Triton kernels (GPU; CPU under TRITON_INTERPRET=1).

A step's batch is prefill sequences first, then decodes (see AttentionMetadata): the prefill part
goes to the varlen paged prefill kernel (or to torch SDPA when every prefill is a fresh prompt in a
16-bit cache), the decode part to split-K paged decode. Neither path
reads a device tensor on the host; the decode path allocates nothing after its first call
(split-K scratch is cached), so a decode-only step can be captured in a CUDA graph.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch

from nanokv.attention.metadata import AttentionMetadata
from nanokv.kernels import triton_decode, triton_prefill, triton_store
from nanokv.kernels.fresh_prefill import int8_as_stored, runs, sdpa_fresh_prefill
from nanokv.kernels.triton_decode_swap import runs_transposed
from nanokv.kv.cache import LayerKVCache

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
    # 2.5% either way, session 8)
    quant_lazy_tau: int = 0
    # int8/int4 decode: query rows of a KV group padded to at least this many (16 = a whole MMA
    # tile; smaller lets Triton pad inside the instruction, with fewer accumulator registers).
    # 0 = by format, as measured on the H200 (docs/kernels.md, session 5): int4 1 (14-15% faster
    # than 16 at both probe shapes), int8 16 (1 was 9% slower at 64 x 4096, equal on ragged lengths)
    quant_min_rows: int = 0
    # int8 decode with both products transposed (triton_decode_swap: query heads on the MMA's N side):
    # tokens per tile, >= 16 and dividing block_size, 0 = off (the kernel above). At 16: 162.6 us vs
    # 215.0 at 64 x 4096, 178.8 vs 217.1 at 256 x 1024, 146.5 vs 186.4 engine-like (H200, session 8);
    # 32- and 64-token tiles were slower (session 9, 32-token blocks: 240.6 vs 218.3 us at 16-token
    # blocks and tiles). (An int4 counterpart, one block per tile, was slower than triton_decode_int4.)
    quant_swap_block_n: int = 16
    # its fewest splits per sequence: 8 fills the H200's last wave of programs better at the long-context
    # decode batch (B 128, lengths over [2048, 4096]: 251.0 vs 277.3 us at 4; session 9's kernel: 226.7
    # vs 236.0, 228.2 at 16), within 3% elsewhere
    quant_swap_min_splits: int = 8
    # its register cap (ptxas .maxnreg; 0 = none). With the scales loaded a tile ahead it compiles to 99
    # registers, 19 one-warp programs per SM; 96 gives 20: 221.2 vs 233.6 us at the long-context decode
    # batch (H200, session 9)
    quant_swap_maxnreg: int = 96
    # its pipeline depth (0 = quant_stages). 3: 212.8 / 215.6 vs 213.9 / 217.3 us at the long-context
    # decode batch (two calls), 113.7 vs 114.9 at 64 sequences, 38.9 vs 44.2 at 16 (engine-like
    # lengths; 60.9 vs 60.3 at 32, 143.3 vs 142.7 at 64 x 4096; H200, session 10)
    quant_swap_stages: int = 3
    # its splits merged inside the kernel by the last program of each (sequence, KV head), not by a
    # second launch (merge_if_last)
    quant_swap_merge: bool = True
    # its split-K target: about this many programs per SM (~20 of its one-warp programs fit at once),
    # the split count rounded down to a power of two. Engine-like lengths up to 4096 (H200, session 10):
    # 16 sequences 35.8 us at 16 splits vs 44.2 at 8; 32 sequences 60.3 at 8 vs 70.8 at 11, 65.2 at 16
    quant_swap_programs_per_sm: int = 16
    # int4 decode through the transposed kernel too (triton_decode_swap4: one block's key scales folded
    # into the query per tile, codes as uint8 tiles), with the quant_swap_* tiles, splits and merge.
    # Long-context decode batch (B 128, lengths over [2048, 4096], 16-token blocks; H200, session 13):
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
    # Long-context decode batch (B 128, lengths over [2048, 4096], 16-token blocks; H200, session 15):
    # 168.2 us vs 188.9 for triton_decode_swap4, the same function (relative difference 1.8e-4)
    quant_cuda4: bool = True
    # its register cap (0 = the compiler's choice, 128; 96: 184.1 us, no spills but more recomputed
    # addresses) and the depth of its copy ring (2 / 3 / 4 stages: 168.2 / 170.8 / 173.3 us)
    quant_cuda4_maxnreg: int = 0
    quant_cuda4_stages: int = 2
    # decode-only steps: the CUDA kernel also quantizes the blocks the step's tokens complete
    # (cuda/fill_int4.cuh), instead of the fill kernel's launch per layer after attention
    quant_cuda4_fill: bool = True
    # its programs ordered by sequence length, longest first (one argsort per step, shared by the
    # layers): over uneven lengths fewer SMs idle at the end of the launch
    quant_cuda4_by_length: bool = True
    # its split count: the power of two nearest to this many waves of programs (16 one-warp programs
    # per SM at 128 registers), at least quant_swap_min_splits; 0 = the Triton kernel's rule. H200,
    # lengths over [2048, 4096], session 16: B 64: 16 splits 100.9 / 101.8 us vs 8 109.0 / 109.6;
    # B 96: 8 splits 126.0 vs 11 132.0; B 128: 8 splits 164.3 vs 12 169.7, 16 179.6
    quant_cuda4_waves: int = 4
    # int8/int4 layers: the model's q/k norm + RoPE kernel (triton_rope) also applies the format's q/k
    # rotation, instead of a separate GEMM per layer and step (nanokv.kv.hooks.fused_rotation).
    # H200 long-context int8 run, session 12: 11,130 tok/s with it vs 10,827 without (one pair)
    qk_rotation_in_rope: bool = True
    decode_splits: int = 0  # 0 = choose from the grid size and SM count; >= 1 forces it
    programs_per_sm: int = 3  # split-K target: about this many decode programs per SM
    min_split_tokens: int = 256  # no split shorter than this (the merge would cost more than it saves)
    max_splits: int = 64
    prefill_block_m: int = 64  # (token, head) rows per program
    prefill_block_n: int = 64
    prefill_warps: int = 4
    prefill_stages: int = 2
    # fresh prompts (no cached prefix) in a 16-bit cache go to torch SDPA (flash), 2.5x faster than
    # the paged prefill kernel on an H200, once the longest is at least this long; 0 = never
    sdpa_prefill_min_tokens: int = 256
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
            raise ValueError(f"NANOKV_TRITON: unknown field {name!r}; allowed: {', '.join(ok)}")
        setattr(cfg, name, val.lower() in ("1", "true", "yes") if isinstance(cur, bool) else int(val))
    return cfg


def config_from_env(cfg: TritonConfig) -> TritonConfig:
    """Kernel A/B runs of whole benchmarks: NANOKV_TRITON="quant_fold_v=0,quant_block_n=64" overrides
    the defaults (apply_overrides)."""
    spec = os.environ.get("NANOKV_TRITON", "").strip()
    apply_overrides(cfg, spec)
    if spec:
        log.info("Triton config from NANOKV_TRITON: %s", cfg)
    return cfg


_SM_COUNT: dict[torch.device, int] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def choose_splits(cfg: TritonConfig, num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int,
                  bits: int = 16, block_size: int = 16) -> int:
    """Split each sequence so that the grid has about programs_per_sm programs per SM (the transposed
    int8 kernel: quant_swap_programs_per_sm), and at least the format's floor of splits.

    Only host-known sizes are used. Under a CUDA graph the count fixed at capture stays valid for
    any lengths: each program derives its own token range from seq_len on the device.
    """
    if cfg.decode_splits > 0:
        return cfg.decode_splits
    want = -(-cfg.programs_per_sm * sms // max(1, num_seqs * num_kv_heads))
    floor = cfg.quant_min_splits if bits < 16 else 1
    if runs_transposed(bits, cfg.quant_swap_block_n, True, block_size,  # (fp16 compute assumed)
                       int4=cfg.quant_swap4 and cfg.quant_fold_k):
        n = max(1, -(-cfg.quant_swap_programs_per_sm * sms // max(1, num_seqs * num_kv_heads)))
        want = 1 << (n.bit_length() - 1)  # rounded down to a power of two (more splits measured slower)
        floor = cfg.quant_swap_min_splits
        if bits == 4 and cfg.quant_cuda4 and cfg.quant_cuda4_waves > 0:  # (the CUDA kernel, where it applies)
            target = cfg.quant_cuda4_waves * 16 * sms / max(1, num_seqs * num_kv_heads)
            want = 1 << max(0, round(math.log2(target)))
    want = max(want, floor)
    by_len = max(1, max_seq_len // cfg.min_split_tokens)
    return max(1, min(want, by_len, cfg.max_splits))


def quant_rows(cfg: TritonConfig, bits: int) -> int:
    """Minimum padded query rows of the quantized decode kernels (TritonConfig.quant_min_rows)."""
    return cfg.quant_min_rows or (1 if bits == 4 else 16)


def decode_options(cfg: TritonConfig, cache: LayerKVCache) -> dict:
    """paged_decode's keyword arguments (all but num_splits) for this cache format."""
    bn, warps, stages = decode_tiles(cfg, cache.quantized)
    q = cache.quantized
    return dict(block_n=bn, num_warps=warps, num_stages=stages, asm=cfg.asm, words=cfg.words,
                fold_k=cfg.quant_fold_k, fold_v=cfg.quant_fold_v, maxnreg=cfg.quant_maxnreg if q else 0,
                lazy_tau=cfg.quant_lazy_tau if q else 0, min_rows=quant_rows(cfg, cache.bits),
                swap_block_n=cfg.quant_swap_block_n if q else 0, swap_maxnreg=cfg.quant_swap_maxnreg,
                swap_stages=cfg.quant_swap_stages, swap_merge=cfg.quant_swap_merge, swap4=cfg.quant_swap4,
                swap4_prefetch=cfg.quant_swap4_prefetch, swap4_maxnreg=cfg.quant_swap4_maxnreg,
                cuda4=cfg.quant_cuda4, cuda4_maxnreg=cfg.quant_cuda4_maxnreg,
                cuda4_stages=cfg.quant_cuda4_stages)


def decode_tiles(cfg: TritonConfig, quantized: bool) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) of the decode kernel for this cache format."""
    if quantized:
        return cfg.quant_block_n, cfg.quant_warps, cfg.quant_stages
    return cfg.decode_block_n, cfg.decode_warps, cfg.decode_stages


class TritonBackend:
    name = "triton"

    def __init__(self, config: TritonConfig | None = None) -> None:
        self.config = config or config_from_env(TritonConfig())
        # float32 caches are for exactness checks: full-precision dots, not Triton's tf32 default
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                      slot_mapping: torch.Tensor) -> None:
        triton_store.store_kvcache(k, v, cache, slot_mapping)

    def _fresh(self, cache: LayerKVCache, md: AttentionMetadata, k: torch.Tensor | None) -> list[int]:
        """Prefills that SDPA serves: whole prompts with no cached prefix, when this step's K/V are
        at hand exactly as attention would read them and the longest is long enough to pay off.
        Exact means a 16-bit cache of the model's dtype, or int4: a block is quantized only after
        the step that fills it, so a fresh prompt reads itself from full-precision staging, which
        holds k and v as given (already rotated). int8 quantizes on the store: its fresh prompts
        attend on the codes read back (int8_as_stored). The others go to the paged prefill kernel."""
        P, lim = md.num_prefills, self.config.sdpa_prefill_min_tokens
        as_read = cache.k_stage if cache.k_stage is not None else cache.k
        if lim <= 0 or k is None or (k.dtype != as_read.dtype and cache.bits != 8):
            return []
        qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
        fresh = [i for i in range(P) if lens[i] == qsl[i + 1] - qsl[i]]
        return fresh if fresh and max(lens[i] for i in fresh) >= lim else []

    def paged_attention(self, q: torch.Tensor, cache: LayerKVCache, md: AttentionMetadata, scale: float,
                        k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D] -> out [T, Hq, D] (written in place when given; else in v's dtype when v is
        given: the model's, q may be fp16, nanokv.kv.hooks.qk_dtype). k, v: this step's K/V
        [T, Hk, D] as just stored (optional: lets fresh prompts skip the cache)."""
        cfg = self.config
        if q.stride(-1) != 1:
            q = q.contiguous()
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype if v is None else v.dtype, device=q.device)
        P = md.num_prefills
        fresh = self._fresh(cache, md, k) if P > 0 else []
        if fresh and k is not None and v is not None:
            if cache.bits == 8:
                sdpa_fresh_prefill(*int8_as_stored(q, cache, md.slot_mapping), md, out, scale, fresh)
            else:
                sdpa_fresh_prefill(q, k, v, md, out, scale, fresh)
        rest = [i for i in range(P) if i not in set(fresh)]
        for a, b in runs(rest):  # usually one run: a chunk continuing, or prompts with a cached prefix
            triton_prefill.paged_prefill(
                q, cache, md.block_tables[a:b], md.seq_lens[a:b], md.query_start_loc[a:b + 1],
                md.max_query_len, out, scale, block_m=cfg.prefill_block_m, block_n=cfg.prefill_block_n,
                num_warps=cfg.prefill_warps, num_stages=cfg.prefill_stages, asm=cfg.asm, words=cfg.words)
        nd = md.num_seqs - P
        if nd > 0:
            s0 = md.num_prefill_tokens
            splits = choose_splits(cfg, nd, cache.num_kv_heads, md.max_seq_len, sm_count(q.device), cache.bits,
                                   cache.block_size)
            # a decode-only step's row i is token i: its slot says whether it completes a staged block
            fill = md.slot_mapping if P == 0 and cache.stage is not None and cfg.quant_cuda4_fill else None
            order = md.decode_order() if cache.bits == 4 and cfg.quant_cuda4 and cfg.quant_cuda4_by_length else None
            triton_decode.paged_decode(q[s0:s0 + nd], cache, md.block_tables[P:], md.seq_lens[P:], out[s0:s0 + nd],
                                       scale, num_splits=splits, fill_slots=fill, seq_order=order,
                                       **decode_options(cfg, cache))
        return out
