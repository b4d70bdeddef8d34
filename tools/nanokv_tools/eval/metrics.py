"""Logit comparison of a setting against the full-precision cache on the same tokens.

Per scored token t with target y: NLL = -log p(y), KL(p_fp || p_setting) over the whole vocabulary
(llama.cpp's KLD direction: the reference distribution first), top-1 agreement = same argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Comparison:
    nll_sum: float = 0.0  # this setting's summed NLL
    ref_nll_sum: float = 0.0  # the full-precision reference's, same tokens
    top1_agree: int = 0
    n: int = 0
    kl: list[torch.Tensor] = field(default_factory=list)  # per-chunk [n] float64

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """ref_logits, logits [n, V] float32; targets [n] int64."""
        ref_lp = torch.log_softmax(ref_logits.double(), dim=-1)
        lp = torch.log_softmax(logits.double(), dim=-1)
        idx = targets.unsqueeze(1)
        self.ref_nll_sum += float(-ref_lp.gather(1, idx).sum())
        self.nll_sum += float(-lp.gather(1, idx).sum())
        self.kl.append((ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0.0))
        self.top1_agree += int((ref_logits.argmax(-1) == logits.argmax(-1)).sum())
        self.n += int(targets.numel())

    def summary(self) -> dict[str, float]:
        if self.n == 0:
            raise ValueError("no tokens scored")
        kl = torch.cat(self.kl) if self.kl else torch.zeros(1, dtype=torch.float64)
        ppl = math.exp(self.nll_sum / self.n)
        ref_ppl = math.exp(self.ref_nll_sum / self.n)
        return {
            "tokens": self.n,
            "ppl": ppl,
            "ref_ppl": ref_ppl,
            "delta_ppl_pct": 100.0 * (ppl / ref_ppl - 1.0),
            "kl_mean": float(kl.mean()),
            "kl_p999": float(torch.quantile(kl, 0.999)),
            "kl_max": float(kl.max()),
            "top1_agreement": self.top1_agree / self.n,
        }
