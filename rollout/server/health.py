"""GenerateHealth: `/health_generate` as SGLang means it: the engine is alive when it finishes a step.

A busy engine (requests in flight) proves it by finishing its next step; nothing is added to its
queue. Only an idle engine gets a one-token probe request, which then runs at once (it queues
behind nothing); a step finished by anything else counts too. No step within the timeout: 503.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

HEALTH_CHECK_TIMEOUT_S = 20.0   # SGLang's default HEALTH_CHECK_TIMEOUT


class GenerateHealth:
    def __init__(self, engine: Any, *, timeout_s: float = HEALTH_CHECK_TIMEOUT_S, poll_s: float = 0.01):
        self.engine = engine
        self.timeout_s = timeout_s
        self.poll_s = poll_s

    async def check(self, make_probe: Callable[[], Any], request: Any) -> tuple[int, dict]:
        """(status, body). make_probe() submits the one-token request (an EngineStream)."""
        engine = self.engine
        if not engine.is_alive:
            return 503, {"status": "error", "message": "the engine stopped"}
        if engine.paused_mode is not None:
            return 200, {"status": "ok", "paused": engine.paused_mode}
        start = engine.steps_done
        busy = engine.num_in_flight > 0
        probe = task = None
        if not busy:
            probe = make_probe()
            task = asyncio.ensure_future(probe.outputs(request))
        deadline = time.monotonic() + self.timeout_s
        try:
            while time.monotonic() < deadline:
                if task is not None and task.done():
                    outs = task.result()
                    return 200, {"status": "ok", "output_ids": outs[0].output_ids}
                # NOTE: idle, the probe's own step is the first; a second means others run too
                if engine.steps_done > start + (0 if busy else 1):
                    return 200, {"status": "ok", "busy": busy}
                if not engine.is_alive:
                    return 503, {"status": "error", "message": "the engine stopped"}
                await asyncio.sleep(self.poll_s)
        finally:
            if task is not None and not task.done():
                task.cancel()
                probe.close()
        return 503, {"status": "error", "message": f"the engine finished no step in {self.timeout_s:g} s"}
