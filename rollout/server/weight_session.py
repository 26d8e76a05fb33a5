"""SGLang's weight-update session (0.5.23 `/begin_weight_update`, `/end_weight_update`, admin).

SGLang opens a session around a tensor push so that weights it quantized in place at load time
are restored to their loadable layout, and re-quantizes them when the session ends; its own
`HttpServerEngineAdapter` and `weight_sync.update_weights` wrap every push in one. This server
keeps weights in their checkpoint dtype (nothing to restore), so no push is refused outside a
session, as SGLang refuses none for such models. What a session does here: it is tracked, a
second begin while one is open and an end without one are answered plainly (200: a trainer that
died inside a session must not lock the next one out), and the reply has SGLang's
`{success, message}`.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from rollout.server.http_io import FieldPolicy, IgnoredFields, json_response, read_json

BEGIN = FieldPolicy(endpoint="/begin_weight_update", acted=frozenset())
END = FieldPolicy(endpoint="/end_weight_update", acted=frozenset())


class WeightSession:
    """Whether a weight-update session is open, and since when."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._opened_at: Optional[float] = None

    def begin(self) -> dict:
        with self._lock:
            if self._opened_at is not None:
                return {"success": True, "message": "a weight update session is already open (kept open)"}
            self._opened_at = time.time()
        return {"success": True, "message": "weight update session opened"}

    def end(self) -> dict:
        with self._lock:
            if self._opened_at is None:
                return {"success": True, "message": "no weight update session was open"}
            opened, self._opened_at = self._opened_at, None
        return {"success": True, "message": f"weight update session closed (open {time.time() - opened:.1f} s)"}

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._opened_at is not None


def add_weight_session_routes(app: FastAPI, session: WeightSession, ignored: IgnoredFields) -> None:
    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request) -> Response:
        BEGIN.screen(await read_json(request, allow_empty=True), ignored)
        return json_response(session.begin())

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request) -> Response:
        END.screen(await read_json(request, allow_empty=True), ignored)
        return json_response(session.end())
