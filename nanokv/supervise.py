"""Keep a few commands running as child processes: the restart loop behind `nanokv up`.

Generic: a Child is a name, a command and where its output goes; what the commands are, their start
order and when one counts as started come from the caller (nanokv.launch). The supervisor

  - starts the children in order, each once the one before is started (`started` says so), and
    gives up (stopping what it started) if one exits during that first start: a bad flag or model
    name would otherwise be retried forever;
  - then restarts any child that exits, after a delay that doubles per exit in a row (base_s, 2x,
    ... up to cap_s) and counts from the first again once a child stayed up stable_s; a child
    that keeps exiting quickly is said to be crash-looping in the log, and is retried at the capped
    delay until someone stops `nanokv up`;
  - writes `<run_dir>/pids.json` ({"up": its own pid, name: pid or null while waiting to restart})
    after every start and exit, so that users and tests can signal a service;
  - on SIGTERM or SIGINT stops them in reverse start order (SIGTERM, SIGKILL after stop_timeout_s);
    a second signal kills what is left at once.

The children run in their own process group (a Ctrl-C in the terminal reaches only the supervisor,
which stops them in order) and get SIGTERM if the supervisor dies (Linux PR_SET_PDEATHSIG: it
follows the thread that forked, so every child is started from the main thread). No torch here.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("nanokv.supervise")
POLL_S = 0.1


@dataclass(frozen=True)
class Backoff:
    base_s: float = 0.5
    cap_s: float = 30.0
    stable_s: float = 60.0  # up at least this long: its next exit counts as the first again
    crash_loop_after: int = 5  # exits in a row, each within stable_s of its start

    def delay(self, exits_in_a_row: int) -> float:
        return min(self.cap_s, self.base_s * 2.0 ** max(0, exits_in_a_row - 1))


@dataclass
class Child:
    name: str
    command: list[str]
    log_path: str | None = None  # None: the supervisor's own stdout and stderr
    # True once started (e.g. its health check answers); only asked during the first start
    started: Callable[[], bool] = lambda: True
    proc: subprocess.Popen | None = None
    since: float = 0.0  # monotonic time of the last start
    exits_in_a_row: int = 0
    restarts: int = 0
    due: float | None = None  # when to start it again (after an exit)
    pids: list[int] = field(default_factory=list)  # every process it ran, oldest first


class StartFailed(RuntimeError):
    pass


def exit_status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


@functools.lru_cache(maxsize=1)
def _prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up in the parent: a dlopen between fork and exec could deadlock on a lock
    another thread (gRPC's) held at the fork."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def _child_setup(prctl: Callable[..., int] | None) -> Callable[[], None]:
    """What the child runs before exec: its own process group, and SIGTERM when the supervisor dies."""
    def setup() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG

    return setup


class Supervisor:
    def __init__(self, children: list[Child], run_dir: str, backoff: Backoff | None = None,
                 stop_timeout_s: float = 15.0, start_timeout_s: float = 600.0):
        self.children = children
        self.run_dir = run_dir
        self.backoff = backoff or Backoff()
        self.stop_timeout_s = stop_timeout_s
        self.start_timeout_s = start_timeout_s
        self.stop_signal: int | None = None
        self._kill_now = False

    @property
    def pid_file(self) -> str:
        return os.path.join(self.run_dir, "pids.json")

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    # ---- signals ------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
        else:
            self._kill_now = True  # a second Ctrl-C: do not wait for graceful exits

    # ---- processes ----------------------------------------------------------------------------
    def _spawn(self, c: Child) -> None:
        out: Any = None
        if c.log_path is not None:
            out = open(c.log_path, "ab")  # noqa: SIM115 - the child keeps its copy
        try:
            c.proc = subprocess.Popen(c.command, stdin=subprocess.DEVNULL, stdout=out,
                                      stderr=subprocess.STDOUT if out is not None else None,
                                      preexec_fn=_child_setup(_prctl()) if sys.platform == "linux" else None)
        finally:
            if out is not None:
                out.close()
        c.since, c.due = time.monotonic(), None
        c.pids.append(c.proc.pid)
        self.write_pids()

    def write_pids(self) -> None:
        pids: dict[str, int | None] = {"up": os.getpid()}
        for c in self.children:
            pids[c.name] = c.proc.pid if c.proc is not None and c.proc.poll() is None else None
        tmp = self.pid_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(pids, f)
        os.replace(tmp, self.pid_file)  # readers never see half a file

    def start_all(self) -> bool:
        """The first start, in order. False if SIGTERM or SIGINT came meanwhile; raises StartFailed if
        a child exited. Either way everything started is stopped again."""
        for c in self.children:
            self._spawn(c)
            log.info("started %s (pid %d)", c.name, c.proc.pid)  # type: ignore[union-attr]
            deadline = time.monotonic() + self.start_timeout_s
            while not c.started():
                rc = c.proc.poll()  # type: ignore[union-attr]
                late = time.monotonic() > deadline
                if rc is not None or late or self.stop_signal is not None:
                    self.stop_all()
                    if rc is not None:
                        raise StartFailed(f"{c.name} exited with {exit_status(rc)} while starting{self._tail(c, 20)}")
                    if late:
                        raise StartFailed(f"{c.name} not started after {self.start_timeout_s:.0f} s{self._tail(c, 20)}")
                    return False
                time.sleep(POLL_S)
        return True

    def run(self) -> int:
        """Restart children that exit until SIGTERM or SIGINT; then stop them all. Returns 0."""
        while self.stop_signal is None:
            now = time.monotonic()
            for c in self.children:
                if c.proc is not None and c.due is None and (rc := c.proc.poll()) is not None:
                    self._exited(c, rc, now)
                if c.due is not None and now >= c.due:
                    c.restarts += 1
                    self._spawn(c)
                    log.warning("restarted %s (pid %d), restart %d", c.name, c.proc.pid,  # type: ignore[union-attr]
                                c.restarts)
            time.sleep(POLL_S)
        log.info("stopping on %s", signal.Signals(self.stop_signal).name)
        self.stop_all()
        return 0

    def _exited(self, c: Child, rc: int, now: float) -> None:
        up_s = now - c.since
        c.exits_in_a_row = 1 if up_s >= self.backoff.stable_s else c.exits_in_a_row + 1
        delay = self.backoff.delay(c.exits_in_a_row)
        c.due = now + delay
        self.write_pids()
        log.warning("%s (pid %d) exited with %s after %.1f s; restart %d in %.2f s%s", c.name, c.proc.pid,  # type: ignore[union-attr]
                    exit_status(rc), up_s, c.restarts + 1, delay, self._tail(c) if rc > 0 else "")
        if c.exits_in_a_row >= self.backoff.crash_loop_after:
            log.error("%s is crash-looping: %d exits in a row, each within %.0f s of its start; retrying every "
                      "%.2f s at most (Ctrl-C stops nanokv up)", c.name, c.exits_in_a_row, self.backoff.stable_s,
                      self.backoff.cap_s)

    def stop_all(self) -> None:
        """Reverse start order (the gateway before compute, compute, which detaches, before the cache)."""
        for c in reversed(self.children):
            p, c.due = c.proc, None
            if p is None or p.poll() is not None:
                continue
            try:
                p.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                p.send_signal(signal.SIGKILL if self._kill_now else signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + self.stop_timeout_s
            while p.poll() is None and time.monotonic() < deadline and not self._kill_now:
                time.sleep(POLL_S)
            if p.poll() is None:
                log.warning("%s (pid %d) still running: SIGKILL", c.name, p.pid)
                p.kill()
            p.wait()
            log.info("%s (pid %d) stopped: %s", c.name, p.pid, exit_status(p.returncode))
        try:
            os.unlink(self.pid_file)  # stale pids could name someone else's process later
        except OSError:
            pass

    @staticmethod
    def _tail(c: Child, lines: int = 5) -> str:
        if c.log_path is None:
            return ""
        try:
            with open(c.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(c.log_path) - 4000))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        last = text.strip().splitlines()[-lines:]
        return f"; the end of {c.log_path}:\n  " + "\n  ".join(last) if last else ""
