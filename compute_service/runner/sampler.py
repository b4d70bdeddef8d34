"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Greedy rows take the argmax of the raw logits, so they are bit-for-bit what an HF greedy run picks.
Random rows use the exponential-race trick (argmax of p / E, E ~ Exp(1)), which draws from p
without a sort or a host sync; seeded rows draw their noise from their own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanokv.sampling import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: (chosen logprob, {token_id: logprob} of the top-n) or None when not asked for
    logprobs: list[tuple[float, dict[int, float]] | None]


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[int, torch.Generator] = {}

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def _generator(self, seq_id: int, seed: int) -> torch.Generator:
        g = self._generators.get(seq_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self._generators[seq_id] = g
        return g

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]) -> SampleResult:
        """logits: [B, V] float32."""
        B = logits.shape[0]
        token_ids = self.sample(logits, params, seq_ids).tolist()
        lps: list[tuple[float, dict[int, float]] | None] = [None] * B
        want = [r for r, p in enumerate(params) if p.logprobs is not None]
        if want:
            logp = torch.log_softmax(logits[want].float(), dim=-1)
            for j, r in enumerate(want):
                n = params[r].logprobs or 0
                top: dict[int, float] = {}
                if n:
                    v, i = logp[j].topk(n)
                    top = dict(zip(i.tolist(), v.tolist()))
                lps[r] = (float(logp[j, token_ids[r]]), top)
        return SampleResult(token_ids, lps)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]) -> torch.Tensor:
        """logits [B, V] (float32, or 16-bit on a GPU) -> chosen token ids [B] int64, on the logits'
        device (no host sync). Greedy rows: argmax of the logits as given (upcasting is exact, so
        16-bit logits pick the same token)."""
        greedy_tok = logits.argmax(dim=-1)  # [B]
        chosen = greedy_tok
        if any(not p.greedy for p in params):
            logits = logits.float()
            temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                                 device=logits.device, dtype=torch.float32)
            scaled = logits / temps.unsqueeze(1)
            scaled = self._filter(scaled, params)
            probs = torch.softmax(scaled, dim=-1)
            noise = torch.empty_like(probs)
            for r, (p, sid) in enumerate(zip(params, seq_ids)):
                if p.greedy:
                    noise[r].fill_(1.0)
                elif p.seed is not None:
                    noise[r].exponential_(generator=self._generator(sid, p.seed))
                else:
                    noise[r].exponential_()
            sampled = (probs / noise).argmax(dim=-1)
            is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
            chosen = torch.where(is_greedy, greedy_tok, sampled)
        return chosen

    @staticmethod
    def _filter(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Mask logits outside top-k / top-p / min-p with -inf (only for rows that ask)."""
        neg = float("-inf")
        if any(p.top_k > 0 for p in params):
            V = scaled.shape[-1]
            ks = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=scaled.device)
            kth = scaled.sort(dim=-1, descending=True).values.gather(1, (ks.clamp(max=V) - 1).unsqueeze(1))
            scaled = scaled.masked_fill(scaled < kth, neg)
        if any(p.top_p < 1.0 for p in params):
            tp = torch.tensor([p.top_p for p in params], device=scaled.device).unsqueeze(1)
            sorted_logits, idx = scaled.sort(dim=-1, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= tp  # keep the token that crosses p
            drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
            scaled = scaled.masked_fill(drop, neg)
        if any(p.min_p > 0.0 for p in params):
            mp = torch.tensor([p.min_p for p in params], device=scaled.device).unsqueeze(1)
            probs = torch.softmax(scaled, dim=-1)
            scaled = scaled.masked_fill(probs < mp * probs.amax(dim=-1, keepdim=True), neg)
        return scaled
