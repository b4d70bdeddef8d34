"""CPU fast path of the torch reference attention: exact-length contexts, one SDPA per sequence.

The generic reference (nanokv.kernels.reference.paged_attention) pads every decode context to the
longest one and masks the rest, and runs prefills through SDPA's math path with an explicit mask.
When the step's caches are unquantized and no sequence has a dropped block (hole), each context is
simply its first seq_len cached tokens, so this path instead:

  1. gathers, once per layer, exactly the blocks the step reads (all sequences back to back) into
     a head-major buffer [H, n_blocks * bs, D]: each sequence's K/V is then a free view
     [H, L, D] of it, with no padding and no permute copy;
  2. runs one SDPA per sequence with no mask where none is needed, which takes torch's fused CPU
     kernel (flash attention) instead of the math path:
       fresh prompt (whole context is this step's tokens): is_causal=True;
       prefill chunk after a cached prefix: bottom-right-aligned causal mask [qlen, L];
       decode: the G = Hq / H query heads sharing a kv head act as G query rows of that head
       ([H, G, D] against [H, L, D]), so each kv head's keys are read once and no mask is needed.

Every score is still the full-precision dot product and every softmax runs over exactly the
sequence's keys, so results equal the masked path up to float rounding order.
The plan (block ids and offsets) is built once per step from host metadata and reused by every layer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanokv.kv.cache import FullKV, LayerKV
from nanokv.kv.metadata import AttentionMetadata

_PLAN_KEY = "cpu_attention_plan"


@dataclass
class StepPlan:
    block_ids: torch.Tensor  # [n_blocks] int64: each sequence's blocks, sequences back to back
    token_start: list[int]  # per sequence: offset of its first key in the gathered [H, n_blocks*bs, D]


def step_plan(md: AttentionMetadata, block_size: int) -> StepPlan | None:
    """The step's gather plan, or None when some sequence has a negative entry: a hole (-1) must be
    masked, and a demoted block (<= -2, hybrid sparsity) lives outside the cache tensors.

    Memoised in md.extras: built by the first layer, reused by the others (tables are host data)."""
    if _PLAN_KEY in md.extras:
        return md.extras[_PLAN_KEY]
    rows = md.block_tables.tolist()
    ids: list[int] = []
    starts: list[int] = []
    plan: StepPlan | None = None
    for i, L in enumerate(md.seq_lens_cpu):
        nb = -(-L // block_size)
        blocks = rows[i][:nb]
        if len(blocks) < nb or min(blocks) < 0:
            break
        starts.append(len(ids) * block_size)
        ids.extend(blocks)
    else:
        plan = StepPlan(torch.tensor(ids, dtype=torch.int64, device=md.block_tables.device), starts)
    md.extras[_PLAN_KEY] = plan
    return plan


def applies(q: torch.Tensor, cache: LayerKV) -> bool:
    """Unquantized cache in q's dtype, on the CPU: the gathered K/V are exactly what was stored.
    Exactly FullKV, not a simulated format (nanokv.kv.fakequant.SimulatedKV): the eval scores it
    against the real quantized cache, which takes the masked path, and the two must round alike to
    compare exactly. (A cache with a demotion store is int8, never this path: it reads only k and v.)"""
    return q.device.type == "cpu" and type(cache) is FullKV and cache.k.dtype == q.dtype


class _Scratch(threading.local):
    """Grow-only buffers for the gathered K and V, reused by every layer of every step (per thread).

    A fresh multi-megabyte tensor per layer is often handed back to the OS when freed and then
    page-faulted in again on the next allocation: measured, 70k page faults and +60% time per decode
    step. Reusing one buffer per side avoids that and the allocation itself."""

    def get(self, side: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        bufs: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = self.__dict__.setdefault("bufs", {})
        key = (side, dtype, device)
        buf = bufs.get(key)
        if buf is None or buf.numel() < numel:
            # a normal tensor (not an inference tensor), so callers in and out of inference mode can
            # both write it; headroom because contexts grow step by step
            with torch.inference_mode(False):
                buf = bufs[key] = torch.empty(numel + numel // 4, dtype=dtype, device=device)
        return buf[:numel]


_SCRATCH = _Scratch()


def gather_heads(x: torch.Tensor, block_ids: torch.Tensor, side: int = 0) -> torch.Tensor:
    """x: a cache tensor [N, H, bs, D]; block_ids [n] -> [H, n * bs, D], contiguous, in scratch
    buffer `side` (valid until the next gather into that side).

    One index_select per head reads whole [bs, D] rows; indexing all heads at once through the
    head-major view is a strided gather, several times slower on the CPU."""
    N, H, bs, D = x.shape
    n = block_ids.numel()
    out = _SCRATCH.get(side, H * n * bs * D, x.dtype, x.device).view(H, n, bs, D)
    for h in range(H):
        torch.index_select(x[:, h], 0, block_ids, out=out[h])
    return out.view(H, n * bs, D)


def paged_attention(q: torch.Tensor, cache: LayerKV, md: AttentionMetadata, scale: float,
                    plan: StepPlan) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D]; K/V of this step are already stored."""
    T, Hq, D = q.shape
    H = cache.num_kv_heads
    G = Hq // H
    k_all, v_all = gather_heads(cache.k, plan.block_ids, 0), gather_heads(cache.v, plan.block_ids, 1)  # [H, *, D]
    out = torch.empty_like(q)
    qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
    for i in range(md.num_seqs):
        s, e, L, t0 = qsl[i], qsl[i + 1], lens[i], plan.token_start[i]
        k, v = k_all[:, t0:t0 + L].unsqueeze(0), v_all[:, t0:t0 + L].unsqueeze(0)  # [1, H, L, D]
        qlen = e - s
        if i >= md.num_prefills:  # decode: one query token, its G heads per kv head as G rows
            qg = q[s].reshape(1, H, G, D)
            out[s] = F.scaled_dot_product_attention(qg, k, v, scale=scale).reshape(Hq, D)
            continue
        qi = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, Hq, qlen, D]
        if qlen == L:  # fresh prompt: plain causal attention over this step's tokens
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=G > 1)
        else:  # chunk after a cached prefix: query j sits at position L - qlen + j
            mask = torch.ones(qlen, L, dtype=torch.bool, device=q.device).tril_(L - qlen)
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=G > 1)
        out[s:e] = o[0].transpose(0, 1)
    return out
