"""Start-up warm-up on a GPU: compile, before serving, the kernels a first busy step would compile.

Triton compiles a kernel variant the first time a step needs it, about a second or two each on the
H200, and the decode graphs captured at start-up cover decode-only steps. A prompt chunked over two
steps takes paths a short fresh prompt does not: its second chunk attends to the first through the
paged prefill kernel, in a step that also decodes. Without this, the first long prompts served paid
those compiles (H200: an int4 cache's first continuing chunk took a 2-s step; under the profiler the
long-context run's device sat idle 1.8 s in its prefill phase, 0.4 s with the warm-up). The engine
runs two small requests through its own scheduler with a token budget that splits one of them, then
forgets them: prefix cache, counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanokv.sampling import SamplingParams

if TYPE_CHECKING:
    from nanokv.gateway.engine import Engine


def warm_up(engine: Engine, force: bool = False) -> None:
    """force: also off a GPU (tests: the warm-up must leave the engine as it found it)."""
    cfg = engine.config
    if (engine.device_type != "cuda" and not force) or not cfg.enable_chunked_prefill:
        return
    bs, vocab = cfg.block_size, engine.model_config.vocab_size
    lens = (bs + 1, 3 * bs + 5)  # prompt tokens; each request then decodes max_tokens = 3
    blocks = sum(-(-(n + 3) // bs) for n in lens)
    if engine.max_model_len < lens[1] + 3 or engine.num_kv_blocks < blocks or cfg.max_num_seqs < 2:
        return  # a context or pool too small for the two requests (tests' toy engines): nothing to warm
    sched = engine.scheduler
    budget = sched.max_num_batched_tokens
    # budget 2 bs + 3. Step 1: all of a (bs + 1 tokens) and the first bs + 2 of b's 3 bs + 5; step 2:
    # a decodes while b goes on from its first chunk, already in the cache (paged prefill); then
    # b's last token beside a decode, then decodes (the captured graphs)
    sched.max_num_batched_tokens = min(budget, 2 * bs + 3)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    try:
        engine.add_request("nanokv-warmup-a", [(7 * i + 1) % vocab for i in range(lens[0])], params)
        engine.add_request("nanokv-warmup-b", [(11 * i + 2) % vocab for i in range(lens[1])], params)
        while engine.has_unfinished_requests():
            engine.step(finished_only=True)
    finally:
        sched.max_num_batched_tokens = budget
    engine.reset_counters()  # (the prefix cache too)
