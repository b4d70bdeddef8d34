"""Tensor parallelism on 2 GPUs (NCCL data plane, CUDA graphs): tp=2 equals tp=1, and a killed
worker ends the engine quickly. Skipped without 2 CUDA devices."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from nanokv.compute_service.runner.tp_comm import TensorParallelError
from nanokv.gateway.llm import LLM
from nanokv.sampling import SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

# fp32 so that a different reduction order cannot flip a greedy choice
KW = dict(model="random:qwen3-0.6b", dtype="float32", num_gpu_blocks=512, block_size=16, max_num_seqs=8,
          max_model_len=1024)
PROMPTS = [list(range(100, 180)), list(range(2000, 2037)), list(range(100, 180)) + [5, 6, 7]]


@pytest.mark.parametrize("eager", [True, False])
def test_tp2_matches_tp1_on_gpus(eager):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    sampled = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=s) for s in range(3)]
    ref_llm = LLM(**KW, enforce_eager=eager)
    ref = ref_llm.generate(PROMPTS, greedy, use_tqdm=False)
    ref_s = ref_llm.generate(PROMPTS, sampled, use_tqdm=False)
    del ref_llm
    torch.cuda.empty_cache()
    tp = LLM(**KW, enforce_eager=eager, tensor_parallel_size=2)
    try:
        start = time.perf_counter()
        outs = tp.generate(PROMPTS, greedy, use_tqdm=False)
        print(f"tp2 eager={eager}: {time.perf_counter() - start:.2f}s for 3x24 tokens")
        outs_s = tp.generate(PROMPTS, sampled, use_tqdm=False)
    finally:
        tp.engine.shutdown()
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.token_ids for o in outs_s] == [o.token_ids for o in ref_s]
    for o, r in zip(outs, ref):
        for a, b in zip(o.logprobs, r.logprobs):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-3)


def test_killed_gpu_worker_fails_fast():
    tp = LLM(**KW, tensor_parallel_size=2)
    eng = tp.engine
    for i in range(4):
        eng.add_request(f"r{i}", PROMPTS[i % 3], SamplingParams(temperature=0.0, max_tokens=800, ignore_eos=True))
    eng.step()
    (pid,) = eng.runner.worker_pids()
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="killed by SIGKILL"):
        while time.monotonic() - start < 60:
            eng.step()
    print(f"error after {time.monotonic() - start:.2f}s")
    assert time.monotonic() - start < 10
