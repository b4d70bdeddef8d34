"""`nanokv up` keeps its services running (nanokv.supervise), as real processes:

  - the supervisor alone, on small commands: a child that keeps exiting is restarted after 0.05,
    0.1, 0.2, 0.2 ... s (doubling to the cap) and called crash-looping; one that stays up past
    stable_s each time is restarted after the base delay each time; one that stays up is left alone;
    SIGTERM then stops them all and removes pids.json;
  - a SIGKILLed supervisor's children get SIGTERM from the kernel and end;
  - the KV segments a killed cache service left are removed when `up` stops (only its own);
  - `nanokv up` itself: SIGKILL of the cache service, then of the compute service, then of the
    gateway; each time the supervisor starts a new one, /ready is 200 again within 30 s of the
    SIGKILL and the same greedy request gives the same tokens; SIGINT then stops every process it
    ever started and leaves no KV segment in shared memory.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import httpx

from nanokv.cache_service.segments import PREFIX, shm_dir
from nanokv.launch import remove_segments
from tests.helpers_up import alive, up_process

RECOVER_S = 30.0
BODY = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is Paris. The capital of Italy is",
        "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1}

SUPERVISOR = textwrap.dedent("""
    import json, logging, sys
    from nanokv.supervise import Backoff, Child, Supervisor
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    py = sys.executable
    sup = Supervisor([Child("steady", ["sleep", "600"]), Child("crasher", ["sh", "-c", "exit 3"]),
                      Child("slow", ["sh", "-c", "sleep 0.8; exit 1"])],
                     sys.argv[1], Backoff(**json.loads(sys.argv[2])))
    sup.install_signal_handlers()
    sup.start_all()
    sys.exit(sup.run())
""")
FAST = {"base_s": 0.05, "cap_s": 0.2, "stable_s": 0.5, "crash_loop_after": 3}


def test_supervisor_backoff_crash_loop_and_sigterm(tmp_path):
    out = tmp_path / "out"
    with open(out, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path), json.dumps(FAST)], stdout=f,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while len(re.findall(r"slow \(pid \d+\) exited", out.read_text())) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
        time.sleep(0.1)
    pids = json.loads((tmp_path / "pids.json").read_text())
    assert pids["up"] == proc.pid and alive(pids["steady"])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    log = out.read_text()
    delays = [float(d) for d in re.findall(r"crasher \(pid \d+\) exited with exit code 3 after [0-9.]+ s; "
                                           r"restart \d+ in ([0-9.]+) s", log)]
    assert delays[:5] == [0.05, 0.1, 0.2, 0.2, 0.2], log  # doubling to the cap
    assert "crasher is crash-looping: 3 exits in a row" in log
    slow = re.findall(r"slow \(pid \d+\) exited with exit code 1 after ([0-9.]+) s; restart (\d+) in ([0-9.]+) s", log)
    assert [(r, d) for _, r, d in slow[:3]] == [("1", "0.05"), ("2", "0.05"), ("3", "0.05")], log  # up long enough
    assert not re.search(r"steady \(pid \d+\) exited|restarted steady", log)
    started = {int(p) for p in re.findall(r"started \w+ \(pid (\d+)\)", log)}
    assert len(started) >= 8 and not any(alive(p) for p in started)
    assert not (tmp_path / "pids.json").exists()


def test_children_die_with_a_killed_supervisor(tmp_path):
    """SIGKILL leaves the supervisor no chance to stop anything: the kernel's parent-death signal does."""
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path), json.dumps(FAST)],
                            stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not (tmp_path / "pids.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    steady = json.loads((tmp_path / "pids.json").read_text())["steady"]
    assert alive(steady)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while alive(steady):
        assert time.monotonic() < deadline, "the child outlived its killed supervisor"
        time.sleep(0.05)


def test_remove_segments_of_dead_cache_services():
    """A cache service killed with no successor leaves its segment: `up` removes those of its own
    cache pids when it stops, and only those."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    mine, other = (os.path.join(shm_dir(), f"{PREFIX}{pid}-{os.urandom(6).hex()}") for pid in (dead.pid, os.getpid()))
    for path in (mine, other):
        open(path, "wb").close()
    try:
        assert remove_segments([dead.pid]) == [os.path.basename(mine)]
        assert not os.path.exists(mine) and os.path.exists(other)
    finally:
        for path in (mine, other):
            if os.path.exists(path):
                os.unlink(path)


def complete(base: str) -> list[str]:
    r = httpx.post(f"{base}/v1/completions", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def wait_recovered(up, name: str, old_pid: int, killed: float) -> float:
    """Seconds from the SIGKILL until a new `name` process runs and /ready answers 200 (after a 503
    or no answer: the gateway saw the outage)."""
    saw_outage = False
    while True:
        elapsed = time.monotonic() - killed
        assert elapsed < RECOVER_S, f"{name}: not ready {RECOVER_S} s after SIGKILL\n{up.output()[-3000:]}"
        assert up.proc.poll() is None, up.output()[-3000:]
        try:
            code = httpx.get(f"{up.base}/ready", timeout=2).status_code
        except httpx.HTTPError:
            code = 0
        saw_outage |= code != 200
        new = up.pids().get(name)
        if saw_outage and code == 200 and new not in (None, old_pid):
            return elapsed
        time.sleep(0.1)


def test_up_restarts_killed_services(tmp_path):
    with up_process(tmp_path, "--grpc-port", "0", stop=signal.SIGINT) as up:
        ref = complete(up.base)
        assert len(ref) == 12
        for name in ("cache", "compute", "gateway"):
            pid = up.pids()[name]
            assert pid is not None and alive(pid)
            os.kill(pid, signal.SIGKILL)
            took = wait_recovered(up, name, pid, time.monotonic())
            print(f"{name} SIGKILL -> ready in {took:.1f} s")
            assert complete(up.base) == ref, name
        log = up.output()
        for name in ("cache", "compute", "gateway"):
            assert re.search(rf"{name} \(pid \d+\) exited with signal SIGKILL after [0-9.]+ s; restart 1 in 0.50 s",
                             log)
            assert re.search(rf"restarted {name} \(pid \d+\), restart 1", log)
    # up_process checked that SIGINT stopped every process it started (the killed ones' successors
    # included) and that no KV segment of any of its cache services is left
    assert "stopping on SIGINT" in up.output()
