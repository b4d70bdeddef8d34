"""A request's prompt token ids, computed as the replica's gateway computes them (its tokenizer, its
chat template: gateway/prompts.py and gateway/http/translate.py), so the router's block hashes are the
replica's. The tokenizer's files come from a replica (GetRoutingInfo): the router needs no model files.
Anything the router cannot read routes by load alone; the replica then answers the request's error."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from nanokv.gateway.http.schemas import ChatCompletionRequest
from nanokv.gateway.http.translate import ModelInfo, chat_inputs
from nanokv.gateway.prompts import chat_prompt
from nanokv.model_files import load_tokenizer
from nanokv.protos import kv_events_pb2 as ev

log = logging.getLogger("nanokv.router")
_ANY_LENGTH = 1 << 30  # the replica checks lengths; the router only reads the prompt


class PromptReader:
    def __init__(self) -> None:
        self.tokenizer: Any = None
        self.loaded = False
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def load(self, info: ev.RoutingInfo) -> None:
        if self.loaded:
            return
        if info.tokenizer_files:
            self._dir = tempfile.TemporaryDirectory(prefix="nanokv-router-tokenizer-")
            for name, data in info.tokenizer_files.items():
                if os.path.basename(name) != name:
                    raise ValueError(f"tokenizer file name {name!r}")
                with open(os.path.join(self._dir.name, name), "wb") as f:
                    f.write(data)
            self.tokenizer = load_tokenizer(self._dir.name, without_torch=True, kind="hf_tokenizer")
        self.loaded = True
        log.info("tokenizer of %s loaded (%d files)", info.model or "the replicas", len(info.tokenizer_files))

    def text(self, text: str) -> list[int] | None:
        if self.tokenizer is None or not text:
            return None
        return [int(t) for t in self.tokenizer(text)["input_ids"]]

    def completion(self, body: Any) -> list[int] | None:
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.text(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        return None

    def chat(self, body: Any) -> list[int] | None:
        if self.tokenizer is None or not isinstance(body, dict):
            return None
        try:
            req = ChatCompletionRequest.model_validate(body)
            messages, _ = chat_inputs(req, ModelInfo(req.model, _ANY_LENGTH))
            return chat_prompt(self.tokenizer, messages)
        except Exception:  # the replica names what is wrong with it
            return None
