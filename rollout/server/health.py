"""GenerateHealth: `/health_generate` as SGLang means it: the engine is alive when it finishes a step;
add_health_routes adds it and `/health`.

A busy engine (requests in flight) proves it by finishing its next step; nothing is added to its
queue. Only an idle engine gets a one-token probe request, which then runs at once (it queues
behind nothing); a step finished by anything else counts too. No step within the timeout: 503.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from rollout.frontend.async_generation import EngineStream
from rollout.generate_io import GenerateArgs
from rollout.server.http_io import error_body, json_response

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
        released = engine.released_memory
        if released:
            # NOTE: SGLang's probe cannot run on released memory either: it gets no step and answers 503
            # after its timeout; here the same 503 at once, saying why
            return 503, {"status": "error", "message": f"the server's memory is released ({', '.join(released)}): "
                                                        f"no step runs until resume_memory_occupation"}
        if engine.weights_inconsistent:
            return 503, {"status": "error", "message": f"the weights are half-updated ({engine.weights_inconsistent}): "
                                                        f"no request runs until a weight update rewrites them"}
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


def add_health_routes(app: FastAPI, engine: Any) -> None:
    """/health (the engine process is alive) and /health_generate (it finishes steps)."""
    info = engine.info
    generate_health = GenerateHealth(engine)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return json_response(error_body("the engine stopped", "server_error", code=503), 503)
        return json_response({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        def probe() -> EngineStream:
            return EngineStream(engine, GenerateArgs(input_ids=[[min(3, info.vocab_size - 1)]],
                                                     sampling_params={"max_new_tokens": 1, "temperature": 0.0}))

        status, body = await generate_health.check(probe, request)
        if status != 200:
            return json_response(error_body(body["message"], "server_error", code=status), status)
        return json_response(body)
