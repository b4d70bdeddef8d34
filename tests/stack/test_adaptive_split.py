"""The adaptive controller of a gateway whose cache and compute services run as their own processes
(real gRPC): its policy rule sees exactly the evidence the in-process controller sees and switches
at the same step; the pool rule grows and shrinks the pool through the attach protocol with greedy
output unchanged; the KV-width rule widens layers through it too. Every block is back at the end."""

from __future__ import annotations

import pytest
import torch

from nanokv.config import EngineConfig
from nanokv.gateway.adaptive.settings import PATIENCE_WINDOWS
from nanokv.gateway.llm import LLM
from nanokv.launch import start_services
from nanokv.sampling import SamplingParams

TINY = {"model": "random:tiny-qwen3", "device": "cpu", "dtype": "float32", "block_size": 8,
        "max_num_batched_tokens": 256}


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def scan_and_hot() -> list[list[int]]:
    """Six 5-block documents read in a loop (30 blocks: more than the 24-block pool, so recency keeps
    none of them) between requests on a hot 3-block prefix: a scan-resistant policy wins."""
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(200, 900, (40,), generator=g).tolist() for _ in range(6)]
    hot = torch.randint(200, 900, (24,), generator=g).tolist()
    return [q for r in range(8) for i, d in enumerate(docs) for q in (d + [10 + r, 11 + i], hot + [20 + r, 30 + i])]


def run_one_by_one(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [llm.generate([q], p, use_tqdm=False)[0].token_ids for q in prompts]


def stream(eng, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Every request's tokens as streamed, one output per token (a token lost in a repool shows)."""
    for i, q in enumerate(prompts):
        eng.add_request(str(i), q, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
            if o.finished:
                assert o.token_ids == got[o.request_id]
    return [got[str(i)] for i in range(len(prompts))]


def split(svc, kw) -> LLM:
    return LLM(**kw, cache_address=svc.cache_address, compute_address=svc.compute_address)


ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@ASYNC
def test_policy_rule_over_rpc_decides_as_in_process(async_scheduling):
    kw = dict(TINY, num_gpu_blocks=24, eviction_policy="adaptive", adaptive_window_steps=4)
    prompts = scan_and_hot()
    local = LLM(**kw)  # (in process, on CPU: synchronous steps)
    want = run_one_by_one(local, prompts, 2)
    lc = local.engine.controller
    with start_services(EngineConfig.from_kwargs(**kw).to_dict()) as svc:
        llm = split(svc, dict(kw, async_scheduling=async_scheduling))
        got = run_one_by_one(llm, prompts, 2)
        sc = llm.engine.controller
        stats = llm.engine.stats()
        llm.engine.shutdown()
    assert got == want
    assert any(d.kind == "eviction_policy" and d.applied for d in sc.decisions)  # it switched, over RPC
    if async_scheduling:  # a pipelined step closes its windows at other steps: the same switch, not the same step
        assert stats["eviction_policy"] == local.engine.cache_manager.policy_name
        return
    # the cache service's ghosts saw the very admissions the gateway-side ghosts saw
    assert [h.ghost_hit_ratios for h in sc.history] == [h.ghost_hit_ratios for h in lc.history]
    assert [(d.step, d.kind, d.action, d.applied) for d in sc.decisions] == \
        [(d.step, d.kind, d.action, d.applied) for d in lc.decisions]
    assert stats["eviction_policy"] == local.engine.cache_manager.policy_name != "clock"
    ls = local.engine.stats()
    assert stats["prefix_hits_tokens"] == ls["prefix_hits_tokens"] > 0
    assert stats["evictions_by_policy"] == ls["evictions_by_policy"]
    assert stats["adaptations"]["eviction_policy"] == 1 and stats["kv_cache_usage"] == 0.0


BLOCK_BYTES = 2 * 2 * 2 * 8 * 16 * 4  # tiny-qwen3: 2 layers x K,V x 2 kv heads x 8 tokens x 16 dims x fp32
PREFIX = list(range(100, 116))


def burst(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [PREFIX + torch.randint(200, 900, (int(10 + 3 * i),), generator=g).tolist() for i in range(n)]


@ASYNC
def test_pool_rule_grows_and_shrinks_through_the_attach_protocol(async_scheduling):
    """A burst of 8 prompts on a 10-block pool with room for 20 more: the pool grows through
    Compute.Repool -> Cache.Attach (a new epoch), live sequences are recomputed, and the greedy
    output equals a run that never resized; idle, it shrinks back."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in LLM(**TINY, num_gpu_blocks=10).generate(burst(8), params, use_tqdm=False)]
    kw = dict(TINY, num_gpu_blocks=10, adaptive=True, adaptive_window_steps=2, adaptive_pool_grow_fraction=0.5,
              adaptive_pool_reserve_bytes=20 * BLOCK_BYTES)
    with start_services(EngineConfig.from_kwargs(**kw).to_dict()) as svc:
        # async: the step in flight lands before each repool, and its tokens still reach the outputs
        llm = split(svc, dict(kw, async_scheduling=async_scheduling))
        eng = llm.engine
        epoch = eng.compute.info().epoch
        assert stream(eng, burst(8), params) == ref
        stats = eng.stats()
        assert stats["adaptations"]["pool_grow"] >= 1 and stats["adaptations"]["pool_shrink"] == 0
        grown = stats["kv_blocks_total"]
        info = eng.compute.info()
        assert grown > 10 and info.num_blocks == grown == eng.num_kv_blocks and info.epoch > epoch
        for _ in range(2 * (PATIENCE_WINDOWS + 1)):  # idle: the server's engine thread ticks like this
            eng.tick_idle()
        stats = eng.stats()
        assert stats["adaptations"]["pool_shrink"] == 1 and stats["kv_blocks_total"] == 10
        assert eng.compute.info().num_blocks == 10
        assert any(d.kind == "pool_shrink" and "idle for" in d.reason for d in eng.controller.decisions)
        # it still serves on the shrunk pool, and every block is back
        assert llm.generate(burst(1), params, use_tqdm=False)[0].token_ids == ref[0]
        assert eng.stats()["kv_cache_usage"] == 0.0 and eng.cache.stats()["num_seqs"] == 0
        eng.shutdown()


@ASYNC
def test_kv_width_rule_widens_layers_through_the_attach_protocol(async_scheduling):
    """Every layer planned int4 with an error bound below int4's error on this model (~0.07 logits)
    and above int8's: the compute service's probe measures it, the gateway widens the layers to
    int8 through Compute.Repool, and the requests finish on the re-attached pool."""
    kw = dict(model="random:tiny-llama", device="cpu", num_gpu_blocks=32, block_size=16, max_num_batched_tokens=256,
              adaptive=True, enable_compression=True, quantization_bitwidth=4, adaptive_window_steps=2,
              adaptive_compression_error_bound=0.03)
    prompts = [[(7 * i + 3 + j) % 997 + 2 for i in range(40)] for j in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with start_services(EngineConfig.from_kwargs(**kw).to_dict()) as svc:
        llm = split(svc, dict(kw, async_scheduling=async_scheduling))
        eng = llm.engine
        assert eng.compute.info().layer_bits == [4, 4]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.token_ids) == 8 for o in outs)
        stats = eng.stats()
        widened = [d for d in eng.controller.decisions if d.kind == "kv_bits"]
        assert widened and widened[0].applied and stats["adaptations"]["kv_bits"] >= 1
        bits = eng.compute.info().layer_bits
        assert bits == eng.model_info.layer_bits and max(bits) == 8  # widened, never past int8 here
        assert eng.controller.logit_error and all(e > 0 for e in eng.controller.logit_error.values())
        assert stats["kv_cache_usage"] == 0.0 and eng.cache.stats()["num_seqs"] == 0
        eng.shutdown()


def test_a_cache_service_without_the_controller_turns_the_policy_rule_off(caplog):
    """The gateway asks for the controller, the services were started without it: the policy rule is
    off with a warning saying why, the other rules run, and requests are served."""
    kw = dict(TINY, num_gpu_blocks=24)
    with start_services(EngineConfig.from_kwargs(**kw).to_dict()) as svc:
        llm = split(svc, dict(kw, adaptive=True, adaptive_window_steps=2))
        ctl = llm.engine.controller
        assert ctl.policy_rule is None and ctl.concurrency_rule is not None
        assert "keeps no ghost caches" in caplog.text
        got = run_one_by_one(llm, scan_and_hot()[:6], 2)
        assert all(len(t) == 2 for t in got) and ctl.step > 2
        llm.engine.shutdown()
