"""TritonBackend: the attention backend interface on the Triton kernels (GPU; CPU under TRITON_INTERPRET=1).

A step's batch is prefill sequences first, then decodes (see AttentionMetadata): the prefill part
goes to the varlen paged prefill kernel, the decode part to split-K paged decode. Neither path
reads a device tensor on the host; the decode path allocates nothing after its first call
(split-K scratch is cached), so a decode-only step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanokv.attention.metadata import AttentionMetadata
from nanokv.kernels import triton_decode, triton_prefill, triton_store
from nanokv.kv.cache import LayerKVCache


@dataclass
class TritonConfig:
    decode_block_n: int = 64  # tokens per K/V tile (any multiple or fraction of the block size)
    decode_warps: int = 4
    decode_stages: int = 2
    decode_splits: int = 0  # 0 = choose from the grid size and SM count; >= 1 forces it
    programs_per_sm: int = 4  # split-K target: this many decode programs per SM
    min_split_tokens: int = 256  # no split shorter than this (the merge would cost more than it saves)
    max_splits: int = 64
    prefill_block_m: int = 64  # (token, head) rows per program
    prefill_block_n: int = 64
    prefill_warps: int = 4
    prefill_stages: int = 2


_SM_COUNT: dict[torch.device, int] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def choose_splits(cfg: TritonConfig, num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int) -> int:
    """Split each sequence so that the grid has about programs_per_sm programs per SM.

    Only host-known sizes are used. Under a CUDA graph the count fixed at capture stays valid for
    any lengths: each program derives its own token range from seq_len on the device.
    """
    if cfg.decode_splits > 0:
        return cfg.decode_splits
    want = -(-cfg.programs_per_sm * sms // max(1, num_seqs * num_kv_heads))
    by_len = max(1, max_seq_len // cfg.min_split_tokens)
    return max(1, min(want, by_len, cfg.max_splits))


class TritonBackend:
    name = "triton"

    def __init__(self, config: TritonConfig | None = None) -> None:
        self.config = config or TritonConfig()

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                      slot_mapping: torch.Tensor) -> None:
        triton_store.store_kvcache(k, v, cache, slot_mapping)

    def paged_attention(self, q: torch.Tensor, cache: LayerKVCache, md: AttentionMetadata, scale: float,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D] -> out [T, Hq, D] (written in place when given)."""
        cfg = self.config
        if q.stride(-1) != 1:
            q = q.contiguous()
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        P = md.num_prefills
        if P > 0:
            triton_prefill.paged_prefill(
                q, cache, md.block_tables[:P], md.seq_lens[:P], md.query_start_loc[:P + 1],
                md.max_query_len, out, scale, block_m=cfg.prefill_block_m, block_n=cfg.prefill_block_n,
                num_warps=cfg.prefill_warps, num_stages=cfg.prefill_stages)
        nd = md.num_seqs - P
        if nd > 0:
            s0 = md.num_prefill_tokens
            splits = choose_splits(cfg, nd, cache.num_kv_heads, md.max_seq_len, sm_count(q.device))
            triton_decode.paged_decode(
                q[s0:s0 + nd], cache, md.block_tables[P:], md.seq_lens[P:], out[s0:s0 + nd], scale,
                num_splits=splits, block_n=cfg.decode_block_n, num_warps=cfg.decode_warps,
                num_stages=cfg.decode_stages)
        return out
