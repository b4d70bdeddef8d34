"""A service's stop on SIGTERM / SIGINT survives a second signal landing inside the first handler
(a parent's SIGTERM and the parent-death SIGTERM together): the service still exits."""

from __future__ import annotations

import subprocess
import sys

# In a fresh interpreter, so that a deadlock shows as a timeout, not a hung test session: the event's
# lock is held as the first handler holds it inside stop.set(), and the second signal's handler runs.
SCRIPT = """
import signal, threading
from nanokv.rpc import stop_on_signals
stop = threading.Event()
stop_on_signals(stop)
handler = signal.getsignal(signal.SIGTERM)
handler(signal.SIGTERM, None)  # the first signal: the service starts to stop
with stop._cond:  # what the first handler holds while it notifies the waiters
    handler(signal.SIGTERM, None)  # a second signal there must return at once
    handler(signal.SIGINT, None)
print("stopped" if stop.is_set() else "running")
"""


def test_a_second_signal_inside_the_first_handler_does_not_deadlock():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "stopped"


def test_the_old_handler_would_have_deadlocked():
    """The same script with a handler that calls stop.set() every time hangs (the check is real)."""
    old = SCRIPT.replace("stop_on_signals(stop)", "signal.signal(signal.SIGTERM, lambda *_: stop.set())")
    try:
        subprocess.run([sys.executable, "-c", old], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return
    raise AssertionError("a handler that sets the event again inside the first one returned")
