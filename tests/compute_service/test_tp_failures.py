"""A tensor-parallel engine never hangs and never leaves processes behind: a worker that dies
mid-run, dies before the rendezvous or raises while loading ends the engine with a clear error
within seconds, and workers of a killed engine exit on their own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

import nanokv.compute_service.runner.tp_procs as tp_procs
import nanokv.compute_service.runner.tp_runner as tp_runner
from nanokv.compute_service.runner.tp_runner import TensorParallelError
from nanokv.gateway.engine import Engine
from nanokv.sampling import SamplingParams
from tests.conftest import live_children

TINY = dict(model="random:tiny-qwen3", num_gpu_blocks=64, block_size=16, tensor_parallel_size=2)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")  # (tests/conftest.py)


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.05)
    return False


def _busy_engine() -> Engine:
    eng = Engine(**TINY)
    for i in range(8):
        eng.add_request(f"r{i}", list(range(5 + i, 60 + i)),
                        SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    eng.step()
    return eng


def test_worker_killed_mid_step_fails_fast():
    eng = _busy_engine()
    (pid,) = eng.runner.worker_pids()
    # steps run back to back, so the kill lands inside one (in a collective, most likely)
    threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL") as info:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            eng.step()
        pytest.fail("the engine kept stepping without its worker")
    assert "during a step" in str(info.value)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(TensorParallelError, match="SIGKILL"):  # and it stays down
        eng.step()


def test_worker_killed_while_idle_fails_next_step():
    eng = _busy_engine()
    (pid,) = eng.runner.worker_pids()
    os.kill(pid, signal.SIGKILL)
    assert _gone([pid], within_s=5.0)
    time.sleep(0.3)  # let the watchdog notice
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="(?s)killed by SIGKILL.*during an idle period"):
        eng.step()
    assert time.monotonic() - start < 1.0


def test_worker_dying_before_rendezvous_fails_start_up(monkeypatch):
    real = tp_procs.mp.start_processes

    def start_then_kill(*args, **kwargs):
        ctx = real(*args, **kwargs)
        for p in ctx.processes:
            os.kill(p.pid, signal.SIGKILL)
        return ctx

    monkeypatch.setattr(tp_procs.mp, "start_processes", start_then_kill)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="(?s)killed by SIGKILL.*during start-up"):
        Engine(**TINY)
    assert time.monotonic() - start < 10.0


def test_worker_raising_while_loading_reports_its_traceback(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from nanokv.compute_service.model.config import ModelConfig
    from nanokv.compute_service.model.loader import random_state_dict, save_hf_folder

    cfg = ModelConfig.preset("tiny-qwen3")
    folder = save_hf_folder(cfg, random_state_dict(cfg), str(tmp_path / "tiny"))
    vocab = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=vocab).save_pretrained(folder)
    real = tp_runner.host_store

    def weights_vanish_after_rank0_loaded(world_size):
        # what a worker sees when its host lacks the file rank 0 read (e.g. another machine)
        os.remove(os.path.join(folder, "model.safetensors"))
        return real(world_size)

    monkeypatch.setattr(tp_runner, "host_store", weights_vanish_after_rank0_loaded)
    with pytest.raises(TensorParallelError, match="(?s)rank 1 .* raised:.*Traceback.*during start-up"):
        Engine(**dict(TINY, model=folder))


_ORPHAN_SCRIPT = """
import sys, time, torch
from nanokv.gateway.engine import Engine
torch.set_num_threads(1)
eng = Engine(model="random:tiny-qwen3", num_gpu_blocks=64, block_size=16, tensor_parallel_size=2)
print(" ".join(map(str, eng.runner.worker_pids())), flush=True)
time.sleep(600)
"""


def test_workers_exit_when_the_engine_process_is_killed():
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert len(line.split()) == 1, line
        pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]  # + resource tracker
        proc.send_signal(signal.SIGKILL)  # no atexit, no shutdown: the workers are on their own
        proc.wait(10)
        assert _gone(pids, within_s=5.0), "a process of the killed engine survived it"
    finally:
        proc.kill()
        proc.wait()


def test_a_second_tp_engine_in_one_process_is_refused_up_front():
    first = Engine(**TINY)
    try:
        before = live_children()
        with pytest.raises(TensorParallelError, match="one TP engine per process"):
            Engine(**TINY)
        assert live_children() == before  # refused before spawning anything
        first.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))
        while first.has_unfinished_requests():
            first.step()  # the first one is unharmed
    finally:
        first.shutdown()
