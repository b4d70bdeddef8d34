"""LLM: the offline API, `LLM(model=...).generate(prompts, SamplingParams)` as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from nanokv.config import EngineConfig
from nanokv.errors import NanoKVError
from nanokv.gateway.engine import Engine, RequestOutput
from nanokv.gateway.sequence import RequestMetrics
from nanokv.sampling import SamplingParams

PromptType = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **config: Any):
        self.engine = Engine(EngineConfig.from_kwargs(model=model, **config))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, cache_salt: str | None = None) -> list[RequestOutput]:
        """Run every prompt to completion. A bad prompt fails alone: its output carries `error`
        and finish_reason 'error'; the rest of the batch runs normally."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise NanoKVError("sampling_params", f"got {len(params)} for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for prompt, p in zip(prompts, params):
            rid = f"gen-{next(self._ids)}"
            order.append(rid)
            try:
                self.engine.add_request(rid, prompt, p, cache_salt=cache_salt)
            except NanoKVError as e:
                results[rid] = RequestOutput(rid, [], [], [], "", "", True, "error", 0, None,
                                             RequestMetrics(0.0), error=str(e))
        bar = tqdm(total=len(prompts), desc="generate", disable=not use_tqdm, unit="req")
        bar.update(len(results))
        while self.engine.has_unfinished_requests():
            for out in self.engine.step(finished_only=True):
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[r] for r in order]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self.engine.apply_chat_template(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(ids, sampling_params, use_tqdm=use_tqdm)
