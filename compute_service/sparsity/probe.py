"""Attention mass per (sequence, logical block), measured on the step's own queries (H2O-like).

The runner puts one AttentionProbe into each step's metadata (md.extras["attn_probe"]); the KV
hook (nanokv.compute_service.kv_hooks.before_store) calls `record` in every layer with the q and k about to be
attended (after rotation, before the store). For each sequence in the step, `record` computes the
softmax weights of the step's queries over the sequence's context exactly as attention does:
cached positions [0, start) read back from the paged cache (holes masked, every format incl.
blocks in hybrid's INT4 demotion store, through the torch reference gather) and this step's keys [start, L) causally.
The weights are summed over heads and over each block's positions and accumulated over layers.

`take()` then reduces over the step's queries, per sequence: the largest mass any one query gave
each block ("max") and the total ("sum"); nanokv.cache_service.sparsity.state accumulates one of them across
steps. Dense per-layer weights are formed for at most `query_chunk` queries at a time.

Cost: one extra attention pass with explicit weights per layer (the reference path; a fused
kernel would emit the block sums from its softmax). CUDA-graph decode steps do not run the hook,
so under graphs the scores come from prefill rows only, and `decode_rows=False` (set by the compute
service whenever it captures graphs) skips the decode rows of eager steps too: a sequence's scores
then do not depend on whether a prefill happened to share its step, and a mixed step does not pay
one reference attention pass per decoding sequence and layer.
"""

from __future__ import annotations

import torch

from nanokv.kernels.reference import gather_kv
from nanokv.kv.cache import LayerKV


class AttentionProbe:
    def __init__(self, query_chunk: int = 256, decode_rows: bool = True, window: int = 0) -> None:
        self.query_chunk = query_chunk
        self.window = window  # score only a row's last `window` queries (0: all; SparsityParams.probe_window)
        self.decode_rows = decode_rows  # score rows of one query (decode) too
        self._acc: list[torch.Tensor | None] = []  # per step row: [n_queries, num_blocks] float32

    def begin(self, md) -> AttentionProbe:
        """Reset for a new step with md.num_seqs sequences; returns self (stored in md.extras)."""
        self._acc = [None] * md.num_seqs
        return self

    @torch.no_grad()
    def record(self, layer: int, cache: LayerKV, md, q: torch.Tensor, k: torch.Tensor) -> None:
        """q [T, Hq, D], k [T, Hk, D]: this step's queries and new keys as attention will use them."""
        bs = cache.block_size
        qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
        for i in range(len(lens)):
            s, e, L = qsl[i], qsl[i + 1], lens[i]
            if i >= md.num_prefills and not self.decode_rows:  # a decode row (a prefill's one-token chunk is not)
                continue
            first = max(s, e - self.window) if self.window else s  # the queries scored: [first, e)
            mass = self._sequence_mass(cache, md.block_tables[i], q[first:e], k[s:e], L, bs)
            acc = self._acc[i]
            self._acc[i] = mass if acc is None else acc + mass

    def _sequence_mass(self, cache: LayerKV, table: torch.Tensor, q: torch.Tensor, k_new: torch.Tensor,
                       L: int, bs: int) -> torch.Tensor:
        """One sequence, one layer -> [n, nb] mass of each block for each of its n queries, the last n of
        its len(k_new) new tokens (positions L - n .. L - 1)."""
        n, Hq, D = q.shape
        H = k_new.shape[1]
        start = L - k_new.shape[0]  # cached positions [0, start), this step's keys [start, L)
        nb = -(-L // bs)
        nb_ctx = -(-start // bs)
        ids = table[:nb_ctx]
        keys = k_new.transpose(0, 1).float()  # [H, n, D]
        valid_ctx = torch.zeros(0, dtype=torch.bool, device=q.device)
        if nb_ctx:
            kc, _ = gather_kv(cache, ids, torch.float32)  # [nb_ctx, H, bs, D]
            kc = kc.permute(1, 0, 2, 3).reshape(H, nb_ctx * bs, D)[:, :start]
            keys = torch.cat([kc, keys], dim=1)  # [H, L, D]
            valid_ctx = (ids != -1).repeat_interleave(bs)[:start]  # <= -2: demoted, still keys
        G = Hq // H
        qg = q.float().reshape(n, H, G, D).permute(1, 2, 0, 3)  # [H, G, n, D]
        out = torch.zeros(n, nb * bs, dtype=torch.float32, device=q.device)
        pos = torch.arange(L, device=q.device)
        for a in range(0, n, self.query_chunk):
            b = min(n, a + self.query_chunk)
            qpos = torch.arange(L - n + a, L - n + b, device=q.device)
            ok = pos.unsqueeze(0) <= qpos.unsqueeze(1)  # [m, L] causal
            ok[:, :start] &= valid_ctx.unsqueeze(0)  # holes give no keys
            # the Llama scale 1/sqrt(D): the probe ranks blocks, it need not match a custom scale
            logits = torch.matmul(qg[:, :, a:b], keys.unsqueeze(1).transpose(-1, -2)) * D ** -0.5
            w = torch.softmax(logits.masked_fill(~ok, float("-inf")), dim=-1)  # [H, G, m, L]
            out[a:b, :L] = w.sum(dim=(0, 1))
        return out.reshape(n, nb, bs).sum(-1)

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per step row: (max over queries [nb], sum over queries [nb]) on the CPU, or None when the
        hook never ran (e.g. a CUDA-graph step). Clears the step's state."""
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for acc in self._acc:
            out.append(None if acc is None else (acc.max(0).values.cpu(), acc.sum(0).cpu()))
        self._acc = []
        return out
