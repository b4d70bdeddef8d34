"""Sequence: one request's tokens, progress and timings. Pure Python (the scheduler's unit)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from nanokv.sampling import SamplingParams

if TYPE_CHECKING:
    from opentelemetry.trace import Span


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenLogprob(TypedDict):
    token_id: int
    logprob: float
    top: dict[int, float]  # the most likely tokens' logprobs (SamplingParams.logprobs of them)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved from params and the context limit
    cache_salt: str | None = None
    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    cached_tokens_by_tier: dict[str, int] | None = None  # that hit per tier, when lower tiers served part
    ever_scheduled: bool = False
    params_sent: bool = False  # the compute service has this sequence's sampling params
    num_preemptions: int = 0
    computed_before_preemption: int = 0  # for the recomputation counter
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprob] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    # detokenizer state
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    sent_text_len: int = 0
    sent_tokens: int = 0
    trace: Span | None = None  # the request's span (nanokv.gateway.traces) while tracing is on

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def set_last_token(self, token_id: int) -> None:
        """Async scheduling: the placeholder appended at launch becomes the sampled token."""
        self.output_token_ids[-1] = token_id
        self.token_ids[-1] = token_id
