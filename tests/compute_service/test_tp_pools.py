"""Tensor parallelism over the cache service's pools: it allocates one per rank (rank 1's in
shared memory, since that rank is another process, even when the cache service runs in rank 0's),
the ranks map them, and a pool change or a cache-service restart re-allocates all of them under a
new epoch, with the greedy tokens of tp=1 (CPU, gloo, fp32; spawned ranks, not torchrun's, which
allocate their own)."""

from __future__ import annotations

import functools
import gc
import os
import signal
import subprocess
import time

import pytest

from nanokv.cache_service.segments import PREFIX, owner_pid, shm_dir
from nanokv.config import EngineConfig
from nanokv.errors import NanoKVError, ServiceUnavailable
from nanokv.gateway.engine import Engine
from nanokv.gateway.llm import LLM
from nanokv.launch import service_command, start_services
from nanokv.rpc import wait_serving
from nanokv.sampling import SamplingParams
from tests.compute_service.test_repool import _run
from tests.compute_service.test_tp_engine import TINY, _tiny_prompts

pytestmark = pytest.mark.usefixtures("no_leftover_processes")  # (tests/conftest.py)

# greedy tokens per request, after `repool_after` steps a pool change (Engine.repool)
_greedy_run = functools.partial(_run, params=SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))


POOLS = dict(TINY, model="random:tiny-qwen3-kv3", num_gpu_blocks=24, max_num_batched_tokens=64, max_num_seqs=4)


def _segments() -> set[str]:
    return {n for n in os.listdir(shm_dir()) if n.startswith(PREFIX)}


def test_tp2_ranks_map_the_cache_services_pools_and_follow_a_repool():
    """The cache service allocates every rank's pool (rank 1: its own KV heads, in shared memory,
    since the rank is another process); the worker writes its KV there; a repool re-allocates all of
    them under a new epoch and the greedy tokens stay those of tp=1."""
    prompts = _tiny_prompts()
    before = _segments()
    ref = _greedy_run(LLM(**POOLS).engine, prompts)
    eng = LLM(**POOLS, tensor_parallel_size=2).engine
    try:
        storage = eng.local_cache.storage
        (rank1,) = storage.ranks
        assert rank1.layout.num_kv_heads == 1 and storage.layout.num_kv_heads == 2  # 3 KV heads, uneven
        assert _greedy_run(eng, prompts) == ref
        assert int((rank1.buffer != 0).sum()) > 0  # written by the worker process, through its mapping
        with pytest.raises(NanoKVError, match="num_blocks"):
            eng.repool(num_blocks=-3)  # refused on rank 0 before any rank drops its pool
        epoch, old_path = eng.model_info.epoch, rank1.path
        assert _greedy_run(eng, prompts, repool_after=4, num_blocks=18) == ref
        (rank1,) = eng.local_cache.storage.ranks
        assert eng.model_info.epoch > epoch and rank1.layout.num_blocks == 18
        assert not os.path.exists(old_path) and os.path.exists(rank1.path)
    finally:
        eng.shutdown()
    del eng, storage, rank1
    gc.collect()
    assert _segments() <= before  # the in-process cache service's rank segments go with it


def test_tp2_through_three_processes_with_a_repool():
    """`nanokv compute --tensor-parallel-size 2`: its worker maps the pool the cache process
    exported for rank 1, and a pool change goes through the same protocol."""
    prompts = _tiny_prompts()
    ref = _greedy_run(LLM(**POOLS).engine, prompts)
    kw = dict(POOLS, tensor_parallel_size=2)
    with start_services(EngineConfig.from_kwargs(**kw).to_dict()) as svc:
        pids = {p.pid for p in svc.procs}
        eng = LLM(**kw, cache_address=svc.cache_address, compute_address=svc.compute_address).engine
        assert _greedy_run(eng, prompts) == ref
        epoch = eng.model_info.epoch
        assert _greedy_run(eng, prompts, repool_after=4, num_blocks=18) == ref
        cache = eng.cache.stats()
        assert eng.model_info.epoch > epoch and cache["attached_epoch"] == eng.model_info.epoch
        assert cache["kv_blocks_total"] == 18
        eng.shutdown()
    assert not {n for n in _segments() if owner_pid(n) in pids}  # the cache process removed its segments


def test_tp2_follows_a_cache_service_restart():
    """The cache process is killed: the step fails at once, the restarted one removes the dead one's
    segments (both ranks'), the compute service re-attaches every rank to new pools, and the same
    prompt gives the same tokens."""
    kw = dict(POOLS, tensor_parallel_size=2, rpc_timeout_s=30.0)
    config = EngineConfig.from_kwargs(**kw).to_dict()
    prompt = _tiny_prompts()[3]
    with start_services(config) as svc:
        eng = Engine(EngineConfig.from_kwargs(**kw, cache_address=svc.cache_address,
                                              compute_address=svc.compute_address))
        before = _greedy_run(eng, [prompt])
        cache = svc.procs[0]
        dead = {n for n in _segments() if owner_pid(n) == cache.pid}
        assert len(dead) == 2  # rank 0's pool and rank 1's
        os.kill(cache.pid, signal.SIGKILL)
        cache.wait()
        eng.add_request("cut", [1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(ServiceUnavailable):
            for _ in range(100):
                eng.step()
        eng.recovery.on_failure(RuntimeError("cache killed"))
        with open(os.path.join(svc.run_dir, "cache2.log"), "ab") as log:
            svc.procs[0] = subprocess.Popen(service_command("cache", config, svc.cache_address), stdout=log,
                                            stderr=subprocess.STDOUT)
        wait_serving(svc.cache_address, 60)
        deadline = time.monotonic() + 60
        while not eng.recovery.try_attach():
            assert time.monotonic() < deadline, eng.recovery.reason
            time.sleep(0.2)
        assert not dead & _segments()
        assert len({n for n in _segments() if owner_pid(n) == svc.procs[0].pid}) == 2
        assert _greedy_run(eng, [prompt]) == before
        eng.shutdown()


def test_tp2_adaptive_widths_and_pool_through_the_services():
    """The adaptive controller across processes at tp=2: the compute service's probe measures int4
    above the error bound on rank 0's heads, the gateway widens every layer on both ranks through
    Compute.Repool, and the pool rule grows every rank's pool the same way; all requests finish."""
    kw = dict(model="random:tiny-llama", num_gpu_blocks=12, block_size=16, max_num_batched_tokens=256,
              adaptive=True, enable_compression=True, quantization_bitwidth=4, adaptive_window_steps=2,
              adaptive_compression_error_bound=0.03, adaptive_pool_grow_fraction=0.5,
              adaptive_pool_reserve_bytes=1 << 20, tensor_parallel_size=2)
    prompts = [[(7 * i + 3 + j) % 997 + 2 for i in range(40)] for j in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with start_services(EngineConfig.from_kwargs(**kw).to_dict()) as svc:
        llm = LLM(**kw, cache_address=svc.cache_address, compute_address=svc.compute_address)
        eng = llm.engine
        epoch = eng.model_info.epoch
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.token_ids) == 8 for o in outs)
        kinds = {d.kind for d in eng.controller.decisions if d.applied}
        assert "kv_bits" in kinds and "pool_grow" in kinds, eng.controller.decisions
        info = eng.compute.info()
        assert max(info.layer_bits) == 8 and info.num_blocks > 12 and info.epoch > epoch
        assert eng.cache.stats()["kv_blocks_total"] == info.num_blocks
        assert eng.stats()["kv_cache_usage"] == 0.0 and eng.cache.stats()["num_seqs"] == 0
        eng.shutdown()


def test_tp2_int4_pool_grows_and_keeps_its_tokens():
    """tp=2 folds no value rotation into the weights (its int4 layers rotate in the hooks): a pool
    change that keeps them int4 is allowed, and greedy tokens equal a run that never resized; a layer
    widened to int8 may go back to int4 and then serves the int4 tokens again."""
    kw = dict(POOLS, model="random:tiny-llama", enable_compression=True, quantization_bitwidth=4,
              tensor_parallel_size=2)
    prompts = _tiny_prompts()
    eng = LLM(**kw).engine
    try:
        ref = _greedy_run(eng, prompts)
        assert _greedy_run(eng, prompts, repool_after=3, num_blocks=30) == ref
        assert eng.model_info.layer_bits == [4, 4] and eng.num_blocks == 30
        eng.repool(layer_bits=[8, 4])
        eng.repool(layer_bits=[4, 4])  # back: the hooks rotate layer 0's values again, on both ranks
        assert _greedy_run(eng, prompts) == ref
    finally:
        eng.shutdown()


def test_tp2_in_process_width_rule_reformats_every_rank():
    """The in-process KV-width rule at tp=2: every rank re-formats its shard in place, in lock step
    (TPModelRunner.reformat_kv). int4 layers re-formatted to 16 bits before any request serve what a
    16-bit engine serves (rank 1 left at int4 would quantize its KV heads); with the controller on
    and async scheduling, the probe on rank 0's heads sees int4 above the bound and the rule widens
    every layer."""
    tiny = dict(POOLS, model="random:tiny-llama")
    ref = _greedy_run(LLM(**tiny).engine, _tiny_prompts())
    eng = LLM(**tiny, enable_compression=True, quantization_bitwidth=4, tensor_parallel_size=2).engine
    try:
        rank1 = eng.local_cache.storage.ranks[0].path
        assert os.path.exists(rank1)
        eng.runner.reformat_kv({0: 16, 1: 16})
        assert eng.runner.layer_bits == [16, 16] and all(c.bits == 16 for c in eng.runner.kv_caches)
        # every rank moved every layer out: the cache service freed the segments, rank 1's file too
        assert eng.local_cache.storage is None and not os.path.exists(rank1)
        assert _greedy_run(eng, _tiny_prompts()) == ref
    finally:
        eng.shutdown()
    kw = dict(model="random:tiny-llama", num_gpu_blocks=24, block_size=16, max_num_batched_tokens=256,
              adaptive=True, enable_compression=True, quantization_bitwidth=4, adaptive_window_steps=2,
              adaptive_compression_error_bound=0.03, tensor_parallel_size=2, async_scheduling=True)
    prompts = [[(7 * i + 3 + j) % 997 + 2 for i in range(40)] for j in range(8)]
    llm = LLM(**kw)  # (async: the step in flight lands before the ranks re-format)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert all(len(o.token_ids) == 8 for o in outs)
        assert any(d.kind == "kv_bits" and d.applied for d in llm.engine.controller.decisions)
        assert max(llm.engine.runner.layer_bits) == 8
        assert llm.engine.stats()["kv_cache_usage"] == 0.0
    finally:
        llm.engine.shutdown()
