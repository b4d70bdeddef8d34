"""A compute service killed mid-request (SIGKILL, real processes, real gRPC): the gateway's step
fails within 5 s with ServiceUnavailable, the gateway turns not-ready, re-attaches once a new compute
service is up, and then serves the same greedy tokens as before."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from nanokv.config import EngineConfig
from nanokv.errors import ServiceUnavailable
from nanokv.gateway.engine import Engine
from nanokv.launch import service_command, start_services
from nanokv.rpc import wait_serving
from nanokv.sampling import SamplingParams

KW = dict(num_gpu_blocks=64, block_size=16, rpc_timeout_s=30.0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _run(eng: Engine, rid: str, prompt: list[int]) -> list[int]:
    eng.add_request(rid, prompt, GREEDY)
    while True:
        for o in eng.step():
            if o.finished:
                return list(o.token_ids)


def test_compute_killed_mid_request_then_restarted(chat_ids):
    config = EngineConfig.from_kwargs(**KW).to_dict()
    with start_services(config) as svc:
        eng = Engine(EngineConfig.from_kwargs(**KW, cache_address=svc.cache_address,
                                              compute_address=svc.compute_address))
        before = _run(eng, "a", chat_ids[0])
        eng.add_request("b", chat_ids[1], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        eng.step()
        compute = svc.procs[1]
        os.kill(compute.pid, signal.SIGKILL)
        compute.wait()
        t0 = time.monotonic()
        with pytest.raises(ServiceUnavailable):
            for _ in range(100):
                eng.step()
        assert time.monotonic() - t0 < 5.0
        eng.recovery.on_failure(RuntimeError("compute killed"))
        assert not eng.ready and not eng.recovery.try_attach()
        log = open(os.path.join(svc.run_dir, "compute2.log"), "ab")
        svc.procs[1] = subprocess.Popen(service_command("compute", config, svc.compute_address, svc.cache_address),
                                        stdout=log, stderr=subprocess.STDOUT)
        wait_serving(svc.compute_address, 300)
        deadline = time.monotonic() + 30
        while not eng.recovery.try_attach():
            assert time.monotonic() < deadline, eng.recovery.reason
            time.sleep(0.2)
        assert eng.ready
        assert _run(eng, "c", chat_ids[0]) == before
        stats = eng.cache.stats()
        assert stats["kv_cache_usage"] == 0.0
        eng.shutdown()
