"""ErrorProbe: per layer, the attention-logit error each candidate KV width would cause on the
rows being stored now, accumulated over a window.

Why logits and not ||k - k~|| / ||k||: the relative key error is dominated by the largest channels,
so outlier keys *lower* it (measured: int4 layer with 300x key outliers, relative error 0.087 ->
0.030) while attention breaks (+24 % perplexity). What attention feels is the score error
q . (k - k~): the probe takes sampled query and key rows of the step (same token positions,
each query head against its kv head) and accumulates the squared score error
(q . (k - dequant(quant(k)))) / sqrt(head_dim) for every width a layer may use. The window figure
is its RMS, in logits: ~0.02-0.03 for int8 and ~0.15-0.45 for int4 on SmolLM2, 3.5 for the
outlier layer at int4 (0.38 at int8). Values are not probed (their error is not amplified by q).

Called by nanokv.compute_service.kv_hooks.before_store through the layer's ``LayerHooks.probe``:
after rotation, on exactly the q/k the backend stores and attends with, on every backend; skipped while a CUDA graph is
captured, so decode steps replayed from graphs are not sampled (prefills and eager steps are).
Cost: one call in ``every`` per layer, ``rows`` rows, a [Hq, rows, rows] score block per width;
the sums stay on the device until the window closes (one sync per layer per window).
"""

from __future__ import annotations

import torch

from nanokv.config import KV_WIDTHS
from nanokv.kv.monitor import roundtrip, spread_rows


def probe_widths(bits: list[int]) -> dict[int, tuple[int, ...]]:
    """{layer: widths to measure} for the layers planned below 16 bits: from the planned width up to 8
    (a layer never goes below its plan; 16 bits has no compression error to measure)."""
    return {i: tuple(w for w in KV_WIDTHS if b <= w < 16) for i, b in enumerate(bits) if b < 16}


class ErrorProbe:
    def __init__(self, widths: dict[int, tuple[int, ...]], every: int = 2, rows: int = 32, seed: int = 0) -> None:
        """widths: {layer: bit widths to measure} (layers absent here are never probed)."""
        if every < 1 or rows < 1:
            raise ValueError("ErrorProbe needs every >= 1 and rows >= 1")
        self.widths = widths
        self.every = every
        self.rows = rows
        self._tick = seed  # rotates the sampled tokens (spread_rows)
        self._calls: dict[int, int] = {}
        self._sq: dict[tuple[int, int], torch.Tensor] = {}  # (layer, bits) -> summed squared error
        self._n: dict[tuple[int, int], int] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """q [T, Hq, D], k and v [T, Hk, D] as handed to the store."""
        widths = self.widths.get(layer)
        if not widths:
            return
        n = self._calls.get(layer, 0)
        self._calls[layer] = n + 1
        if n % self.every or k.shape[0] == 0:
            return
        T, Hq, D = q.shape
        Hk = k.shape[1]
        idx = spread_rows(T, self.rows, self._tick, k.device)
        self._tick += 1
        if idx is not None:
            q, k = q[idx], k[idx]
        m = k.shape[0]
        qg = q.float().reshape(m, Hk, Hq // Hk, D)
        kf = k.float()
        for bits in widths:
            err = kf - roundtrip(k, bits, torch.float32)
            scores = torch.einsum("ihgd,jhd->hgij", qg, err) * D**-0.5
            key = (layer, bits)
            sq = scores.pow(2).sum()
            self._sq[key] = self._sq[key] + sq if key in self._sq else sq
            self._n[key] = self._n.get(key, 0) + scores.numel()

    def window_errors(self) -> dict[int, dict[int, float]]:
        """{layer: {bits: RMS logit error}} since the last call, for the layers sampled; resets."""
        sq, n = self._sq, self._n
        self._sq, self._n = {}, {}
        out: dict[int, dict[int, float]] = {}
        for (layer, bits), total in sq.items():
            out.setdefault(layer, {})[bits] = (float(total) / n[(layer, bits)]) ** 0.5
        return out

