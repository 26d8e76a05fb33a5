"""HealthProber: polls a server's /health on one kept-alive connection from a thread of its own and
records the longest time the server took to answer (the event loop's worst stall, seen from outside)."""
from __future__ import annotations

import threading
import time
from typing import Optional

import httpx


class HealthProber:
    """`with HealthProber(url) as p: ...` then p.worst_s (longest /health answer or gap), p.failures."""

    def __init__(self, url: str, period_s: float = 0.01, timeout_s: float = 60.0):
        self.url = url
        self.period_s = period_s
        self.timeout_s = timeout_s
        self.worst_s = 0.0
        self.probes = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _run(self) -> None:
        # NOTE: at least one probe, however soon the test ends (a test of a few ms ended before the
        # thread's first loop test and the fixture then found no probe)
        with httpx.Client(base_url=self.url, timeout=self.timeout_s) as c:
            while True:
                t0 = time.perf_counter()
                try:
                    status = c.get("/health").status_code
                    if status != 200:
                        self.failures.append(f"/health answered {status}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"/health failed: {exc!r}")
                self.worst_s = max(self.worst_s, time.perf_counter() - t0)
                self.probes += 1
                if self._stop.wait(self.period_s):
                    return

    def __enter__(self) -> "HealthProber":
        self._thread = threading.Thread(target=self._run, name="health-prober", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 5)
