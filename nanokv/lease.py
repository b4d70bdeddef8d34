"""Gateway leases: the cache and compute services hold sequences on a gateway's behalf; a gateway
that says nothing for `lease_s` (no plan, no step) is taken for dead and everything it held is
released, so a killed gateway cannot pin KV blocks forever (EngineConfig.gateway_lease_s).

A live gateway renews its lease with every call; an idle one holds no sequences, so its lease
running out releases nothing. Pure Python, no torch, no grpc.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Leases:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic):
        self.lease_s = lease_s
        self.clock = clock
        self._renewed: dict[str, float] = {}  # holder -> last call
        self._lock = threading.Lock()

    def renew(self, holder: str) -> None:
        with self._lock:
            self._renewed[holder] = self.clock()

    def drop(self, holder: str | None = None) -> None:
        """Forget `holder` (None: every holder): it released what it held itself."""
        with self._lock:
            if holder is None:
                self._renewed.clear()
            else:
                self._renewed.pop(holder, None)

    def expired(self) -> list[str]:
        """Holders whose lease ran out; they are forgotten (each is reported once)."""
        now = self.clock()
        with self._lock:
            gone = [h for h, t in self._renewed.items() if now - t > self.lease_s]
            for h in gone:
                del self._renewed[h]
        return gone


def start_reaper(leases: Leases, release: Callable[[str], object], stop: threading.Event) -> threading.Thread:
    """A daemon thread that calls release(holder) for every expired lease, checking about four times
    per lease period, so a dead gateway's sequences go within 1.25 x gateway_lease_s."""
    interval = max(0.05, min(leases.lease_s / 4, 5.0))

    def run() -> None:
        while not stop.wait(interval):
            for holder in leases.expired():
                log.warning("gateway %s silent for %.0f s: releasing everything it held", holder or "?",
                            leases.lease_s)
                try:
                    release(holder)
                except Exception:  # noqa: BLE001 - the reaper must outlive one failed release
                    log.exception("releasing gateway %s", holder)

    t = threading.Thread(target=run, name="nanokv-lease-reaper", daemon=True)
    t.start()
    return t
