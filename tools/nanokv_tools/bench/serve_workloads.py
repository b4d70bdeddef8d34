"""What `nanokv bench serve` sends, and when: requests as exact token ids, and their arrival times.

A workload is built once per run (its shape: lengths, hash ids, conversation turns, all from --seed)
and rendered into token ids once per request rate under that rate's namespace, so each rate starts
from a cold prefix cache while every rate sends the same shape. Prompts are token ids, not text, so
their lengths are exact on any server that takes token-id prompts (vLLM, SGLang, nanokv).

Trace workloads (Mooncake JSONL, the simulator's generated conversations) carry one hash id per
block of the input, prefix-chained; each hash id becomes a deterministic block of `block_tokens`
tokens, so requests that share hash-id prefixes share prompt prefixes and the server's prefix cache
hits for real. Chat turns are closed-loop: a turn's prompt is its previous turn's prompt, a stand-in
for the answer of the length the server actually produced, and a new user message; it is sent only
after that answer arrived.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from nanokv.errors import NanoKVError
from nanokv_tools.sim.traces import MOONCAKE_TRACE, TraceRequest, conversation, read_mooncake

WORKLOADS = ("mooncake", "conversation", "chat", "random")


@dataclass
class Shape:
    """One request before rendering: its arrival in the trace, output budget, and what its prompt is made of."""

    timestamp_s: float  # in the trace (trace-timed arrivals); 0 when the workload has no clock
    max_tokens: int
    hash_ids: list[int] = field(default_factory=list)  # trace workloads: one per block
    last_block_tokens: int = 0  # tokens of the last (partial) block; trace workloads
    random_len: int = 0  # random workload: tokens after the shared prefix
    parent: int | None = None  # chat: the index of the previous turn (sent once it has answered)
    system: int = 0  # chat: which shared system prompt, and its length (first turns only)
    system_len: int = 0
    user_len: int = 0  # chat: this turn's new user message
    conv: int = -1  # chat: conversation and turn, for the records
    turn: int = 0


@dataclass
class TokenSource:
    """Deterministic token ids for named pieces of content, within one namespace."""

    namespace: str
    lo: int
    hi: int

    def piece(self, name: str, n: int) -> list[int]:
        rng = random.Random(f"{self.namespace}:{name}")  # str seeds are stable across processes
        return [rng.randrange(self.lo, self.hi) for _ in range(n)]


def _from_trace(reqs: list[TraceRequest], trace_block: int, block_tokens: int, max_out: int,
                max_input: int | None) -> list[Shape]:
    out = []
    for r in reqs:
        ids = list(r.hash_ids)
        if not ids:
            continue
        rem = r.input_length - trace_block * (len(ids) - 1)  # tokens in the last block, 1..trace_block
        last = max(1, min(block_tokens, -(-max(rem, 1) * block_tokens // trace_block)))
        if max_input is not None and (len(ids) - 1) * block_tokens + last > max_input:
            keep = max(1, max_input // block_tokens)  # whole blocks only: shared prefixes stay shared
            ids, last = ids[:keep], block_tokens
        out.append(Shape(r.timestamp / 1000.0, max(1, min(r.output_length, max_out)), ids, last))
    return out


def build_shapes(workload: str, *, num_prompts: int, seed: int, max_output_tokens: int, block_tokens: int = 16,
                 trace: str | None = None, trace_block_tokens: int = 512, max_input_tokens: int | None = None,
                 input_len: int = 128, output_len: int = 16, range_ratio: float = 0.0,
                 chat_turns: int = 3, chat_systems: int = 2, chat_system_len: int = 64,
                 chat_user_len: int = 24) -> list[Shape]:
    """`num_prompts` request shapes of `workload` (one of WORKLOADS)."""
    if workload not in WORKLOADS:
        raise NanoKVError("workload", f"got {workload!r}; allowed: {', '.join(WORKLOADS)}")
    for name, v in (("num_prompts", num_prompts), ("block_tokens", block_tokens), ("max_output_tokens",
                    max_output_tokens), ("trace_block_tokens", trace_block_tokens), ("chat_turns", chat_turns)):
        if v < 1:
            raise NanoKVError(name, f"got {v}; must be at least 1")
    if not 0.0 <= range_ratio < 1.0:
        raise NanoKVError("random_range_ratio", f"got {range_ratio}; allowed: 0 <= r < 1")
    rng = random.Random(seed)
    if workload == "mooncake":
        reqs = read_mooncake(trace or MOONCAKE_TRACE)[:num_prompts]
        return _from_trace(reqs, trace_block_tokens, block_tokens, max_output_tokens, max_input_tokens)
    if workload == "conversation":
        if trace is not None:
            raise NanoKVError("trace", "only the mooncake workload reads a trace file")
        minutes = 5.0
        while True:  # the generator's window grows until it holds num_prompts requests
            reqs = conversation(trace_block_tokens, minutes=minutes, seed=seed)
            if len(reqs) >= num_prompts or minutes > 24 * 60:
                break
            minutes *= 2
        t0 = reqs[0].timestamp if reqs else 0.0
        conv = _from_trace(reqs[:num_prompts], trace_block_tokens, block_tokens, max_output_tokens, max_input_tokens)
        for s in conv:
            s.timestamp_s -= t0 / 1000.0
        return conv
    if workload == "random":  # vLLM's random dataset: lengths uniform in [len * (1 - r), len * (1 + r)]
        def draw(n: int) -> int:
            return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))
        return [Shape(0.0, min(draw(output_len), max_output_tokens), random_len=draw(input_len))
                for _ in range(num_prompts)]
    # chat: conversations of `chat_turns` turns on a few shared system prompts, interleaved in arrival order
    convs = -(-num_prompts // chat_turns)
    shapes: list[Shape] = []
    last: dict[int, int] = {}  # conversation -> index of its latest turn so far
    order = [c for c in range(convs) for _ in range(chat_turns)]
    rng.shuffle(order)  # turns of different conversations interleave; a conversation's own stay in order
    for c in order[:num_prompts]:
        prev = last.get(c)
        user = max(1, int(rng.expovariate(1 / chat_user_len)))
        out_len = max(1, min(max_output_tokens, int(rng.expovariate(1 / output_len)) + 1))
        shapes.append(Shape(0.0, out_len, parent=prev, system=c % chat_systems, system_len=chat_system_len,
                            user_len=user, conv=c, turn=0 if prev is None else shapes[prev].turn + 1))
        last[c] = len(shapes) - 1
    return shapes


def render_prompt(shape: Shape, index: int, src: TokenSource, block_tokens: int, prefix_len: int = 0,
                  parent_prompt: list[int] | None = None, parent_output_tokens: int = 0) -> list[int]:
    """The token ids of one request. Chat turns after the first need their parent's prompt and the
    number of tokens it answered with."""
    if shape.conv >= 0:
        if shape.parent is None:
            head = src.piece(f"sys{shape.system}", shape.system_len)
        else:
            if parent_prompt is None:
                raise ValueError("a follow-up turn needs its parent's prompt")
            head = parent_prompt + src.piece(f"a{shape.conv}.{shape.turn - 1}", parent_output_tokens)
        return head + src.piece(f"u{shape.conv}.{shape.turn}", shape.user_len)
    if shape.hash_ids:
        out: list[int] = []
        for i, h in enumerate(shape.hash_ids):
            block = src.piece(f"h{h}", block_tokens)
            out += block if i < len(shape.hash_ids) - 1 else block[:shape.last_block_tokens]
        return out
    return src.piece("prefix", prefix_len) + src.piece(f"r{index}", shape.random_len)


def arrival_times(n: int, rate: float, *, seed: int, burstiness: float = 1.0, trace_s: list[float] | None = None,
                  trace_speedup: float = 1.0) -> list[float]:
    """Seconds after the start at which each of `n` requests is due.

    rate inf: all at once. Otherwise gaps drawn from a gamma distribution of mean 1 / rate and shape
    `burstiness` (1: exponential gaps, a Poisson process; below 1 burstier, above 1 more regular), the
    first request at 0, as vLLM's serving benchmark does. With `trace_s`, the trace's own times
    divided by `trace_speedup` instead (rate ignored)."""
    if trace_s is not None:
        if trace_speedup <= 0:
            raise NanoKVError("trace_speedup", f"got {trace_speedup}; must be > 0")
        t0 = trace_s[0] if trace_s else 0.0
        return [(t - t0) / trace_speedup for t in trace_s[:n]]
    if not rate > 0:
        raise NanoKVError("request_rate", f"got {rate}; must be > 0 or inf")
    if rate == float("inf"):
        return [0.0] * n
    if burstiness <= 0:
        raise NanoKVError("burstiness", f"got {burstiness}; must be > 0")
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out

