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

import torch

from nanokv.kernels import triton_decode, triton_hybrid, triton_prefill, triton_store
from nanokv.kernels.fresh_prefill import int8_as_stored, runs, sdpa_fresh_prefill
from nanokv.kernels.triton_config import TritonConfig, default_config
from nanokv.kernels.triton_decode_swap import runs_transposed
from nanokv.kv.cache import Int4KV, Int8KV, LayerKV
from nanokv.kv.demote import HybridInt8KV
from nanokv.kv.metadata import AttentionMetadata

log = logging.getLogger(__name__)


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


def decode_options(cfg: TritonConfig, cache: LayerKV) -> dict:
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
                cuda4_stages=cfg.quant_cuda4_stages, cuda4_tiles=cfg.quant_cuda4_tiles,
                cuda4_direct=cfg.quant_cuda4_direct_launch)


def decode_tiles(cfg: TritonConfig, quantized: bool) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) of the decode kernel for this cache format."""
    if quantized:
        return cfg.quant_block_n, cfg.quant_warps, cfg.quant_stages
    return cfg.decode_block_n, cfg.decode_warps, cfg.decode_stages


class TritonBackend:
    name = "triton"

    def __init__(self, config: TritonConfig | None = None) -> None:
        self.config = config or default_config()
        # float32 caches are for exactness checks: full-precision dots, not Triton's tf32 default
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, cache: LayerKV,
                      slot_mapping: torch.Tensor) -> None:
        triton_store.store_kvcache(k, v, cache, slot_mapping)

    def _fresh(self, cache: LayerKV, md: AttentionMetadata, k: torch.Tensor | None) -> list[int]:
        """Prefills that SDPA serves: whole prompts with no cached prefix, when this step's K/V are
        at hand exactly as attention would read them and the longest is long enough to pay off.
        Exact means a 16-bit cache of the model's dtype, or int4: a block is quantized only after
        the step that fills it, so a fresh prompt reads itself from full-precision staging, which
        holds k and v as given (already rotated). int8 quantizes on the store: its fresh prompts
        attend on the codes read back (int8_as_stored). The others go to the paged prefill kernel."""
        P, lim = md.num_prefills, self.config.sdpa_prefill_min_tokens
        as_read = cache.k_stage if isinstance(cache, Int4KV) else cache.k
        if lim <= 0 or k is None or (k.dtype != as_read.dtype and cache.bits != 8):
            return []
        qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
        fresh = [i for i in range(P) if lens[i] == qsl[i + 1] - qsl[i]]
        return fresh if fresh and max(lens[i] for i in fresh) >= lim else []

    def paged_attention(self, q: torch.Tensor, cache: LayerKV, md: AttentionMetadata, scale: float,
                        k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D] -> out [T, Hq, D] (written in place when given; else in v's dtype when v is
        given: the model's, q may be fp16, nanokv.compute_service.kv_hooks.qk_dtype). k, v: this step's K/V
        [T, Hk, D] as just stored (optional: lets fresh prompts skip the cache). A decode launch that
        also quantized the int4 blocks the step fills sets md.fills_quantized (AttentionMetadata)."""
        cfg = self.config
        if q.stride(-1) != 1:
            q = q.contiguous()
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype if v is None else v.dtype, device=q.device)
        P = md.num_prefills
        fresh = self._fresh(cache, md, k) if P > 0 else []
        if fresh and k is not None and v is not None:
            if isinstance(cache, Int8KV):
                sdpa_fresh_prefill(*int8_as_stored(q, cache, md.slot_mapping), md, out, scale, fresh,
                                   cudnn=self.config.fresh_prefill_cudnn)
            else:
                sdpa_fresh_prefill(q, k, v, md, out, scale, fresh, cudnn=self.config.fresh_prefill_cudnn)
        rest = [i for i in range(P) if i not in set(fresh)]
        if isinstance(cache, HybridInt8KV):  # hybrid sparsity: tables mix pool blocks, INT4 slots and holes
            self._hybrid(q, cache, md, scale, out, rest)
            return out
        q4 = cache.bits == 4
        for a, b in runs(rest):  # usually one run: a chunk continuing, or prompts with a cached prefix
            triton_prefill.paged_prefill(
                q, cache, md.block_tables[a:b], md.seq_lens[a:b], md.query_start_loc[a:b + 1],
                md.max_query_len, out, scale, block_m=q4 and cfg.quant4_prefill_block_m or cfg.prefill_block_m,
                block_n=cfg.prefill_block_n, num_warps=q4 and cfg.quant4_prefill_warps or cfg.prefill_warps,
                num_stages=cfg.prefill_stages, asm=cfg.asm, words=cfg.words, tile_kinds=cfg.prefill_tile_kinds)
        nd = md.num_seqs - P
        if nd > 0:
            s0 = md.num_prefill_tokens
            splits = choose_splits(cfg, nd, cache.num_kv_heads, md.max_seq_len, sm_count(q.device), cache.bits,
                                   cache.block_size)
            # a decode-only step's row i is token i: its slot says whether it completes a staged block
            fill = md.slot_mapping if P == 0 and isinstance(cache, Int4KV) and cfg.quant_cuda4_fill else None
            order = md.decode_order() if cache.bits == 4 and cfg.quant_cuda4 and cfg.quant_cuda4_by_length else None
            md.fills_quantized = triton_decode.paged_decode(
                q[s0:s0 + nd], cache, md.block_tables[P:], md.seq_lens[P:], out[s0:s0 + nd], scale,
                num_splits=splits, fill_slots=fill, seq_order=order, **decode_options(cfg, cache))
        return out

    def _hybrid(self, q: torch.Tensor, cache: HybridInt8KV, md: AttentionMetadata, scale: float, out: torch.Tensor,
                rest: list[int]) -> None:
        """The prefills in `rest` and every decode of the step on nanokv.kernels.triton_hybrid."""
        cfg = self.config
        for a, b in runs(rest):
            triton_hybrid.hybrid_prefill(
                q, cache, md.block_tables[a:b], md.seq_lens[a:b], md.query_start_loc[a:b + 1], md.max_query_len,
                out, scale, block_m=cfg.prefill_block_m, block_n=cfg.prefill_block_n, num_warps=cfg.prefill_warps,
                num_stages=cfg.prefill_stages)
        nd = md.num_seqs - md.num_prefills
        if nd > 0:
            s0, H = md.num_prefill_tokens, cache.num_kv_heads
            splits = choose_splits(cfg, nd, H, md.max_seq_len, sm_count(q.device), 16, cache.block_size)
            # the block kernel (one branch per block, holes skipped) where its tile fits: at the s = 0.5
            # mix it times 0.11-0.18 ms against the tile kernel's 0.24 and the int8 decode's 0.18
            # (Llama-3-8B and Qwen3-0.6B shapes, batch 32, 8k context, H100: docs/kernels.md)
            half = cache.head_dim // 2
            per_block = cache.block_size % 16 == 0 and half >= 16 and half & (half - 1) == 0
            triton_hybrid.hybrid_decode(q[s0:s0 + nd], cache, md.block_tables[md.num_prefills:],
                                        md.seq_lens[md.num_prefills:], out[s0:s0 + nd], scale, num_splits=splits,
                                        block_n=cfg.decode_block_n, num_warps=cfg.decode_warps,
                                        num_stages=cfg.decode_stages, per_block=per_block)
