"""Fresh prompts (no cached prefix) on a GPU: attention over the step's own K/V with varlen flash.

A prompt whose whole context is this step's tokens needs no paged gather: its K/V are at hand
exactly as the cache will return them (16-bit caches, int4 staging), or are read back once from the
cache (int8: the codes later steps read). torch's flash kernel is ~2.5x the paged prefill kernel on
an H200 (docs/kernels.md).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from nanokv.kernels import triton_store
from nanokv.kv.cache import Int8KV
from nanokv.kv.metadata import AttentionMetadata

log = logging.getLogger(__name__)


_VARLEN_OK: list[bool] = [True]  # flips off (once, logged) if this torch build lacks varlen flash


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                  scale: float) -> torch.Tensor | None:
    """Causal flash attention over packed sequences (cu [n + 1] int32 offsets), GQA native:
    q [T, Hq, D], k and v [T, Hk, D] -> [T, Hq, D]. None where unavailable (CPU, old torch)."""
    if not (_VARLEN_OK[0] and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return None
    try:
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False,
                                                      scale=scale)
        return out[0]
    except (RuntimeError, TypeError, AttributeError) as e:  # noqa: PERF203 - one-time probe
        _VARLEN_OK[0] = False
        log.warning("varlen flash attention unavailable (%s); fresh prompts use per-sequence SDPA", e)
        return None


_CUDNN_OK: list[bool] = [True]  # flips off (once, logged) if cuDNN's attention rejects these shapes


def _cudnn_per_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qsl: list[int], seqs: list[int],
                      out: torch.Tensor, scale: float) -> bool:
    """Causal attention of each listed prompt through cuDNN (SDPA restricted to that backend, GQA
    native), written into out. False (nothing trusted written) where cuDNN cannot serve."""
    if not (_CUDNN_OK[0] and q.is_cuda and q.dtype == torch.float16):
        return False
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for i in seqs:
                s, e = qsl[i], qsl[i + 1]
                o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None],
                                                   v[s:e].transpose(0, 1)[None], is_causal=True, scale=scale,
                                                   enable_gqa=q.shape[1] != k.shape[1])
                out[s:e] = o[0].transpose(0, 1)
    except RuntimeError as e:  # no cuDNN attention in this build, or not for these shapes
        _CUDNN_OK[0] = False
        log.warning("cuDNN attention unavailable (%s); fresh prompts use varlen flash", e)
        return False
    return True


def sdpa_fresh_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata, out: torch.Tensor,
                       scale: float, seqs: list[int], cudnn: bool = False) -> None:
    """Prefill sequences whose whole context is this step's tokens, attended on the K/V this step
    just computed (q [T, Hq, D], k and v [T, Hk, D]; exactly what was stored, so no gather from
    the cache): one varlen flash call per run of consecutive sequences on a GPU, else causal SDPA
    per sequence. cudnn: fp16 prompts one by one through cuDNN's attention where it serves
    (TritonConfig.fresh_prefill_cudnn). Host offsets only (query_start_loc_cpu)."""
    qsl = md.query_start_loc_cpu
    G = q.shape[1] // k.shape[1]
    if cudnn and _cudnn_per_prompt(q, k, v, qsl, seqs, out, scale):
        return
    for a, b in runs(seqs):
        s, e = qsl[a], qsl[b]
        cu = md.query_start_loc[a:b + 1] - md.query_start_loc[a]
        o = _flash_varlen(q[s:e], k[s:e], v[s:e], cu, max(qsl[i + 1] - qsl[i] for i in range(a, b)), scale)
        if o is not None:
            out[s:e] = o
            continue
        for i in range(a, b):
            s, e = qsl[i], qsl[i + 1]
            # heads expanded by hand: SDPA's enable_gqa falls back to the slow math path on some builds
            kk, vv = k[s:e], v[s:e]
            if G > 1:
                kk, vv = kk.repeat_interleave(G, dim=1), vv.repeat_interleave(G, dim=1)
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                                               is_causal=True, scale=scale)
            out[s:e] = o.transpose(0, 1)


def int8_as_stored(q: torch.Tensor, cache: Int8KV, slots: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash operands for fresh prompts in an int8 cache: (q, k, v) in the quantized kernels'
    compute dtype (fp16 unless fp32), K/V [T, Hk, D] read back from the cache at the step's slots
    (codes x scale), so a fresh prompt attends to exactly what later steps and prefix hits read.
    Only the step's rows are dequantized, never the cache."""
    dt = torch.float32 if q.dtype == torch.float32 else torch.float16
    k, v = triton_store.read_back_int8(cache, slots, dt)
    return q.to(dt), k, v


def runs(idx: list[int]) -> list[tuple[int, int]]:
    """Sorted indices -> maximal [a, b) ranges of consecutive ones."""
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out
