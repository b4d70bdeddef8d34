"""SamplingParams: per-request decoding controls (vLLM's names), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanokv.errors import RequestError


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context limit
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token (0 = only the chosen)
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise RequestError(name, f"must be a number, got {v!r}")
            return float(v)

        t = number("temperature")
        if not 0.0 <= t <= 100.0 or t != t:
            raise RequestError("temperature", f"got {t}; allowed: 0 (greedy) to 100")
        p = number("top_p")
        if not 0.0 < p <= 1.0:
            raise RequestError("top_p", f"got {p}; allowed: (0, 1]")
        m = number("min_p")
        if not 0.0 <= m <= 1.0:
            raise RequestError("min_p", f"got {m}; allowed: [0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError("top_k", f"got {self.top_k!r}; allowed: -1 or 0 (off) or a positive integer")
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise RequestError("max_tokens", f"must be an integer, got {self.max_tokens!r}")
            if self.max_tokens < 1:
                raise RequestError("max_tokens", f"got {self.max_tokens}; must be at least 1")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63
        ):
            raise RequestError("seed", f"got {self.seed!r}; allowed: an integer in [0, 2**63)")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError("stop", "must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > 16:
            raise RequestError("stop", f"at most 16 stop strings, got {len(self.stop)}")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.stop_token_ids
        ):
            raise RequestError("stop_token_ids", "must be a list of non-negative token ids")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20
        ):
            raise RequestError("logprobs", f"got {self.logprobs!r}; allowed: an integer from 0 to 20")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
