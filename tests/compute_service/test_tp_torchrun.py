"""torchrun launch on one host (CPU, gloo): rank 0 runs the engine, rank 1 serves it.

Run directly by torchrun, this file is the user script of docs/tensor-parallel.md; under pytest it
launches itself with `torchrun --standalone --nproc-per-node 2` and compares with tp=1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

PROMPTS = [list(range(5, 41)), list(range(300, 317))]
KW = dict(model="random:tiny-qwen3", num_gpu_blocks=64, block_size=16)


def _generate(**extra) -> list[list[int]]:
    from nanokv.gateway.llm import LLM
    from nanokv.sampling import SamplingParams

    llm = LLM(**KW, **extra)
    try:
        params = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=s) for s in range(2)]
        return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_torchrun_two_ranks_match_tp1(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    out = tmp_path / "tokens.json"
    env = dict(os.environ, NANOKV_TP_TEST_OUT=str(out), OMP_NUM_THREADS="1")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", __file__], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == _generate()


if __name__ == "__main__":
    from nanokv.compute_service.runner.tp_worker import run_worker_if_torchrun

    run_worker_if_torchrun()  # rank 1 serves rank 0's engine here, then exits
    tokens = _generate(tensor_parallel_size=int(os.environ["WORLD_SIZE"]))
    with open(os.environ["NANOKV_TP_TEST_OUT"], "w") as f:
        json.dump(tokens, f)
