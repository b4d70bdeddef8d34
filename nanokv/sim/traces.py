"""Request traces: the Mooncake JSONL reader and synthetic workload generators.

Every trace is a list of ``TraceRequest`` in the Mooncake shape: one hash id per
``block_size_tokens`` block of the input (last block partial), prefix-chained: equal ids at
position i imply identical first i+1 blocks. Synthetic generators build token streams out of
named segments and assign chained ids with a trie, so sharing is exact by construction.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from nanokv.errors import NanoKVError


@dataclass
class TraceRequest:
    timestamp: float  # ms from trace start (unused by the replay, kept for arrival modelling)
    input_length: int  # tokens
    output_length: int
    hash_ids: list[int]  # one per block of the input, prefix-chained


def read_mooncake(path: str | Path) -> list[TraceRequest]:
    """Read a Mooncake FAST'25 JSONL trace; requests are returned in timestamp order (stable)."""
    p = Path(path)
    if not p.is_file():
        raise NanoKVError("trace", f"no such trace file: {p}")
    out: list[TraceRequest] = []
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                req = TraceRequest(float(rec.get("timestamp", 0)), int(rec["input_length"]),
                                   int(rec.get("output_length", 0)), [int(h) for h in rec["hash_ids"]])
            except (ValueError, KeyError, TypeError) as exc:
                raise NanoKVError("trace", f"{p}:{lineno}: not a Mooncake record ({exc!r})") from exc
            if req.input_length < 0 or (req.input_length > 0 and not req.hash_ids):
                raise NanoKVError("trace", f"{p}:{lineno}: input_length/hash_ids inconsistent")
            out.append(req)
    out.sort(key=lambda r: r.timestamp)
    return out


# ---- synthetic workloads ------------------------------------------------------------------------
Segment = tuple[str, int]  # (segment name, length in tokens): equal names mean equal tokens


class _ChainIds:
    """Assigns dense prefix-chained ids to blocks of segment streams (a trie over block contents)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._ids: dict[tuple[int, tuple[tuple[str, int, int], ...]], int] = {}

    def ids(self, segments: Sequence[Segment]) -> tuple[list[int], int]:
        bs = self.block_size
        pieces: list[tuple[str, int, int]] = []  # (segment, start, end) inside the current block
        out: list[int] = []
        parent, fill, total = -1, 0, 0
        for name, length in segments:
            pos = 0
            while pos < length:
                take = min(bs - fill, length - pos)
                pieces.append((name, pos, pos + take))
                pos += take
                fill += take
                if fill == bs:
                    parent = self._id(parent, pieces)
                    out.append(parent)
                    pieces, fill = [], 0
            total += length
        if pieces:
            out.append(self._id(parent, pieces))
        return out, total

    def _id(self, parent: int, pieces: list[tuple[str, int, int]]) -> int:
        key = (parent, tuple(pieces))
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = len(self._ids)
        return got


def _build(streams: list[tuple[float, list[Segment], int]], block_size: int) -> list[TraceRequest]:
    chain = _ChainIds(block_size)
    out = []
    for ts, segs, out_len in sorted(streams, key=lambda s: s[0]):
        ids, n = chain.ids(segs)
        out.append(TraceRequest(ts, n, out_len, ids))
    return out


def shared_prompt(block_size: int = 512, *, groups: int = 64, prompts_per_group: int = 16,
                  prefix_len: int = 2048, question_len: int = 128, seed: int = 0) -> list[TraceRequest]:
    """SGLang generated-shared-prefix: groups x prompts, one system prompt per group, random order."""
    rng = random.Random(seed)
    reqs = [(g, q) for g in range(groups) for q in range(prompts_per_group)]
    rng.shuffle(reqs)
    streams = [(float(i), [(f"sys{g}", prefix_len), (f"q{g}.{q}", question_len)], 256)
               for i, (g, q) in enumerate(reqs)]
    return _build(streams, block_size)


def multi_turn(block_size: int = 512, *, conversations: int = 200, turns: int = 6, system_len: int = 600,
               user_len: int = 300, answer_len: int = 400, rate: float = 4.0, think_s: float = 20.0,
               seed: int = 0) -> list[TraceRequest]:
    """Chat sessions: turn t re-sends the whole history (system + all previous user/assistant)."""
    rng = random.Random(seed)
    streams: list[tuple[float, list[Segment], int]] = []
    start = 0.0
    for c in range(conversations):
        start += rng.expovariate(rate)
        t = start
        hist: list[Segment] = [(f"sys{c % 4}", system_len)]  # a few shared system prompts
        for k in range(turns):
            hist = hist + [(f"u{c}.{k}", max(1, int(rng.expovariate(1 / user_len))))]
            ans = max(1, int(rng.expovariate(1 / answer_len)))
            streams.append((t * 1000, list(hist), ans))
            hist = hist + [(f"a{c}.{k}", ans)]
            t += rng.expovariate(1 / think_s)
    return _build(streams, block_size)


def rag(block_size: int = 512, *, requests: int = 4000, documents: int = 2000, doc_len: int = 3000,
        docs_per_request: int = 2, zipf_s: float = 1.1, system_len: int = 1000, question_len: int = 100,
        seed: int = 0) -> list[TraceRequest]:
    """RAG: shared system prompt + k retrieved documents (Zipf popularity, ordered by rank) + question."""
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) ** zipf_s for r in range(documents)]
    streams: list[tuple[float, list[Segment], int]] = []
    for i in range(requests):
        docs = sorted(set(rng.choices(range(documents), weights=weights, k=docs_per_request)))
        segs: list[Segment] = [("sys", system_len)] + [(f"doc{d}", doc_len) for d in docs]
        streams.append((float(i), segs + [(f"q{i}", question_len)], 128))
    return _build(streams, block_size)


def phase_change(block_size: int = 512, *, phase_requests: int = 1500, groups: int = 32,
                 prefix_len: int = 4096, question_len: int = 128, doc_len: int = 16384,
                 scan_share: float = 0.8, seed: int = 0) -> list[TraceRequest]:
    """Shared system prompts; then mostly long one-off documents (``scan_share`` of the requests,
    the rest still use the prompts); then prompts only again. Built to test scan resistance and
    policy switching: the best policy differs between the phases."""
    rng = random.Random(seed)
    streams: list[tuple[float, list[Segment], int]] = []
    t = 0
    for phase in range(3):
        for _ in range(phase_requests):
            if phase == 1 and rng.random() < scan_share:
                segs: list[Segment] = [(f"doc{t}", doc_len), (f"q{t}", question_len)]
            else:
                g = min(int(rng.paretovariate(1.2)) - 1, groups - 1)
                segs = [(f"sys{g}", prefix_len), (f"q{t}", question_len)]
            streams.append((float(t), segs, 128))
            t += 1
    return _build(streams, block_size)


SYNTHETIC: dict[str, Callable[..., list[TraceRequest]]] = {
    "shared_prompt": shared_prompt,
    "multi_turn": multi_turn,
    "rag": rag,
    "phase_change": phase_change,
}


def load_trace(spec: str, block_size: int = 512) -> list[TraceRequest]:
    """``FILE`` (Mooncake JSONL) or ``synthetic:NAME``."""
    if spec.startswith("synthetic:"):
        name = spec.split(":", 1)[1]
        if name not in SYNTHETIC:
            raise NanoKVError("trace", f"unknown synthetic trace {name!r}; allowed: {', '.join(SYNTHETIC)}")
        return SYNTHETIC[name](block_size)
    return read_mooncake(spec)
