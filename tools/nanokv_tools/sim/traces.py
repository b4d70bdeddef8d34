"""Request traces: the Mooncake JSONL reader and synthetic workload generators.

Every trace is a list of ``TraceRequest`` in the Mooncake shape: one hash id per
``block_size_tokens`` block of the input (last block partial), prefix-chained: equal ids at
position i imply identical first i+1 blocks. Synthetic generators build token streams out of
named segments and assign chained ids with a trie, so sharing is exact by construction.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from nanokv.errors import NanoKVError

# the Mooncake FAST'25 synthetic trace (Apache-2.0), vendored: see data/README.md beside this package
MOONCAKE_TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl"


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


class _Stream:
    """One growing token stream (a conversation, an agent loop) over a shared ``_ChainIds``: the ids of
    its full blocks are kept, so each extension hashes only the new tail (O(new blocks), not O(history))."""

    def __init__(self, chain: _ChainIds, segments: Sequence[Segment] = ()) -> None:
        self.chain = chain
        self.full: list[int] = []
        self.pieces: list[tuple[str, int, int]] = []
        self.fill = 0
        self.parent = -1
        self.total = 0
        for name, length in segments:
            self.extend(name, length)

    def extend(self, name: str, length: int) -> None:
        bs, pos = self.chain.block_size, 0
        while pos < length:
            take = min(bs - self.fill, length - pos)
            self.pieces.append((name, pos, pos + take))
            pos += take
            self.fill += take
            if self.fill == bs:
                self.parent = self.chain._id(self.parent, self.pieces)
                self.full.append(self.parent)
                self.pieces, self.fill = [], 0
        self.total += length

    def ids(self) -> list[int]:
        """The ids of the stream as one request's input (the partial last block included)."""
        return self.full + [self.chain._id(self.parent, self.pieces)] if self.pieces else list(self.full)


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


# ---- workloads calibrated to published statistics (docs/cache-policies.md, "Workloads") -----------
def _lognormal(rng: random.Random, median: float, sigma: float, lo: int = 1, hi: int = 1 << 30) -> int:
    return max(lo, min(hi, int(median * math.exp(rng.gauss(0.0, sigma)))))


def _geometric(rng: random.Random, mean: float, cap: int) -> int:
    """1, 2, 3, ... with P(k) = (1 - q) q^(k-1), mean ``mean`` (before the cap)."""
    q = 1.0 - 1.0 / mean
    k = 1
    while k < cap and rng.random() < q:
        k += 1
    return k


def _zipf_picker(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    cum = list(itertools.accumulate(1.0 / (r + 1) ** s for r in range(n)))
    return lambda: min(bisect.bisect_left(cum, rng.random() * cum[-1]), n - 1)


def conversation(block_size: int = 512, *, minutes: float = 60.0, request_rate: float = 3.34,
                 mean_turns: float = 3.5, chats_per_user: float = 2.0, user_gap_s: float = 300.0,
                 apps: int = 16, system_median: int = 300, personal_share: float = 0.3,
                 personal_median: int = 300, doc_share: float = 0.0, doc_median: int = 3000,
                 user_median: int = 40, answer_median: int = 150, think_median_s: float = 120.0,
                 think_sigma: float = 1.8, decode_tps: float = 30.0, warmup_s: float = 4 * 3600.0,
                 seed: int = 0) -> list[TraceRequest]:
    """Multi-turn chat. Users arrive; each opens a few conversations one after another; every turn
    re-sends the whole conversation - the app's system prompt, the user's own prefix (custom
    instructions, memory), an optional attached document, all earlier user messages and answers -
    after the user's think time. The window opens in steady state (users active ``warmup_s`` before
    it), as a slice of a real service would.

    Calibration (docs/cache-policies.md, "Workloads", has the sources and the generated statistics):
    3.34 requests/s for an hour (Mooncake FAST'25 conversation trace: 12,031 requests in 1 h); turns
    per conversation geometric, mean 3.5 (ShareGPT: 330,239 turns / 94,145 conversations; 71%
    multi-turn, CachedAttention reports 73%); user message and answer log-normal with the LMSYS-Chat-1M
    means (69.5 and 214.5 tokens); think time log-normal, median 120 s, sigma 1.8, so 81% of the
    turns come within 10 minutes (Alibaba to-C trace: 80% of reuses within 10 minutes), plus the
    answer's decode time at ``decode_tps``. Assumed: 16 apps (Zipf popularity) with ~300-token system
    prompts; 30% of users carry a ~300-token personal prefix into each of their conversations (most
    hits are within one user: Alibaba to-C); a user opens 2 conversations on average, ~5 minutes
    apart; ``doc_share`` of the conversations open on a document (``long_conversation``)."""
    rng = random.Random(seed)
    chain = _ChainIds(block_size)
    app = _zipf_picker(rng, apps, 1.0)
    sys_len = [_lognormal(rng, system_median, 0.7, 64) for _ in range(apps)]
    horizon = minutes * 60.0
    users = request_rate / (mean_turns * chats_per_user)  # new users per second
    events: list[tuple[float, list[int], int, int]] = []
    t, u, c = -warmup_s, 0, 0  # users active before the window: it opens in steady state, mid-conversation
    while True:
        t += rng.expovariate(users)
        if t >= horizon:
            break
        a = app()
        prefix: list[Segment] = [(f"sys{a}", sys_len[a])]
        if rng.random() < personal_share:
            prefix.append((f"me{u}", _lognormal(rng, personal_median, 1.0, 16, 32_000)))
        ts = t
        for _ in range(_geometric(rng, chats_per_user, 32)):
            stream = _Stream(chain, prefix)
            if rng.random() < doc_share:
                stream.extend(f"doc{c}", _lognormal(rng, doc_median, 1.0, 256, 100_000))
            for k in range(_geometric(rng, mean_turns, 64)):
                if ts >= horizon:
                    break
                stream.extend(f"u{c}.{k}", _lognormal(rng, user_median, 1.05, 1, 16_000))
                ans = _lognormal(rng, answer_median, 0.85, 1, 4096)
                if ts >= 0:
                    events.append((ts, stream.ids(), stream.total, ans))
                stream.extend(f"a{c}.{k}", ans)
                ts += ans / decode_tps + min(_lognormal_s(rng, think_median_s, think_sigma), 3600.0)
            ts += min(_lognormal_s(rng, user_gap_s, 1.0), 3600.0)
            c += 1
        u += 1
    events.sort(key=lambda e: e[0])
    return [TraceRequest(ts * 1000.0, n, out, ids) for ts, ids, n, out in events]


def long_conversation(block_size: int = 512, **kw: float) -> list[TraceRequest]:
    """Long-context chat (documents, long system prompts): ``conversation`` with a quarter of the
    conversations opening on a document (median 6k tokens, heavy tail), 32 apps with ~1k-token system
    prompts, half the users carrying a ~1.5k-token personal prefix, and answers of median 250 tokens
    (mean 344, the Mooncake conversation output mean). Requests average ~6k tokens, toward the Kimi
    traces' long contexts."""
    args: dict[str, float] = dict(apps=32, system_median=1000, personal_share=0.5, personal_median=1500,
                                  doc_share=0.25, doc_median=6000, user_median=60, answer_median=250)
    args.update(kw)
    return conversation(block_size, **args)  # type: ignore[arg-type]


def _lognormal_s(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def tool_agent(block_size: int = 512, *, minutes: float = 30.0, request_rate: float = 6.56, mean_steps: float = 4.0,
               agents: int = 6, tools_median: int = 3000, task_median: int = 300, action_median: int = 150,
               result_median: int = 400, gap_median_s: float = 1.6, gap_sigma: float = 2.6,
               decode_tps: float = 50.0, seed: int = 0) -> list[TraceRequest]:
    """Tool-calling agents: an agent's system prompt (tool schemas, shared by every task of that agent,
    Zipf popularity) + the task, then a loop: the model emits an action, the tool's result is appended
    and the whole context is sent again after the tool's latency.

    Defaults: 6.56 requests/s (Mooncake FAST'25 tool&agent trace: 23,608 requests in 1 h); action
    log-normal, median 150 tokens (Mooncake tool&agent output mean 182); tool latency log-normal,
    median 1.6 s, sigma 2.6 (p75 9 s, p90 44 s, mean 46 s: a production agent trace's inter-turn gaps,
    p50 1.6 s / p75 8.6 s / p90 44 s / mean 37 s); steps per task geometric, mean 4."""
    rng = random.Random(seed)
    chain = _ChainIds(block_size)
    agent = _zipf_picker(rng, agents, 1.0)
    tools = [_lognormal(rng, tools_median, 0.5, 256) for _ in range(agents)]
    horizon = minutes * 60.0
    tasks = request_rate / mean_steps
    events: list[tuple[float, list[int], int, int]] = []
    t, c = 0.0, 0
    while True:
        t += rng.expovariate(tasks)
        if t >= horizon:
            break
        a = agent()
        stream = _Stream(chain, [(f"tools{a}", tools[a]), (f"task{c}", _lognormal(rng, task_median, 1.0))])
        ts = t
        for k in range(_geometric(rng, mean_steps, 64)):
            if ts >= horizon:
                break
            act = _lognormal(rng, action_median, 0.8, 1, 4096)
            events.append((ts, stream.ids(), stream.total, act))
            stream.extend(f"act{c}.{k}", act)
            stream.extend(f"res{c}.{k}", _lognormal(rng, result_median, 1.2, 1, 32_000))
            ts += act / decode_tps + _lognormal_s(rng, gap_median_s, gap_sigma)
        c += 1
    events.sort(key=lambda e: e[0])
    return [TraceRequest(ts * 1000.0, n, out, ids) for ts, ids, n, out in events]


def concat(parts: Sequence[list[TraceRequest]]) -> list[TraceRequest]:
    """Phases one after another: ids of each part are shifted past the previous parts' (no sharing
    between phases) and timestamps follow on."""
    out: list[TraceRequest] = []
    base_id, base_ts = 0, 0.0
    for part in parts:
        top, last = -1, 0.0
        for r in part:
            out.append(TraceRequest(base_ts + r.timestamp, r.input_length, r.output_length,
                                    [h + base_id for h in r.hash_ids]))
            top = max(top, max(r.hash_ids, default=-1))
            last = r.timestamp
        base_id += top + 1
        base_ts += last + 1.0
    return out


def mixed_phases(block_size: int = 512, *, minutes: float = 15.0, seed: int = 0) -> list[TraceRequest]:
    """A service whose traffic changes: chat, then tool agents, then RAG, then chat again (each phase
    its own content). The best static policy differs between phases."""
    rng = random.Random(seed)
    seeds = [rng.randrange(1 << 30) for _ in range(4)]
    return concat([
        conversation(block_size, minutes=minutes, seed=seeds[0]),
        tool_agent(block_size, minutes=minutes / 2, seed=seeds[1]),
        rag(block_size, requests=int(minutes * 60 * 2), seed=seeds[2]),
        conversation(block_size, minutes=minutes, seed=seeds[3]),
    ])


def chat_prompts(conversations: int = 12, *, vocab: int = 30_000, apps: int = 2, system_len: int = 24,
                 user_len: int = 6, answer_len: int = 10, suffix_len: int = 8, mean_turns: float = 3.0,
                 active: int = 4, seed: int = 0) -> list[list[int]]:
    """Token-level multi-turn chat for the engine (tests, docs: "Simulator vs engine"): prompts as token
    ids, in arrival order. ``active`` conversations interleave; each turn re-sends the conversation so
    far (shared system prompt, earlier user messages and answers) plus this turn's message and a
    request-specific suffix of ``suffix_len`` tokens that the next turn does not carry (the way a
    per-request tail - a date line, retrieved memory, a generation prompt - makes a prompt's last full
    block dead). Answers are fixed tokens, not the model's: the stream is the same whatever it says."""
    rng = random.Random(seed)
    counter = itertools.count(1000)

    def fresh(n: int) -> list[int]:
        return [next(counter) % (vocab - 1000) + 1000 for _ in range(max(1, n))]

    systems = [fresh(system_len) for _ in range(apps)]
    live: list[tuple[list[int], int]] = []  # (history, turns left)
    started = 0
    out: list[list[int]] = []
    while started < conversations or live:
        if started < conversations and (len(live) < active or rng.random() < 0.2):
            live.append((list(systems[rng.randrange(apps)]), _geometric(rng, mean_turns, 16)))
            started += 1
        k = rng.randrange(len(live))
        history, left = live[k]
        history = history + fresh(rng.randint(user_len // 2, user_len * 2))
        out.append(history + fresh(suffix_len) if suffix_len else list(history))
        history = history + fresh(rng.randint(answer_len // 2, answer_len * 2))
        if left > 1:
            live[k] = (history, left - 1)
        else:
            live.pop(k)
    return out


SYNTHETIC: dict[str, Callable[..., list[TraceRequest]]] = {
    "conversation": conversation,
    "long_conversation": long_conversation,
    "tool_agent": tool_agent,
    "shared_prompt": shared_prompt,
    "rag": rag,
    "multi_turn": multi_turn,
    "phase_change": phase_change,
    "mixed_phases": mixed_phases,
}


def load_trace(spec: str, block_size: int = 512) -> list[TraceRequest]:
    """``FILE`` (Mooncake JSONL) or ``synthetic:NAME``."""
    if spec.startswith("synthetic:"):
        name = spec.split(":", 1)[1]
        if name not in SYNTHETIC:
            raise NanoKVError("trace", f"unknown synthetic trace {name!r}; allowed: {', '.join(SYNTHETIC)}")
        return SYNTHETIC[name](block_size)
    return read_mooncake(spec)
