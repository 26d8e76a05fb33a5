"""GracefulServer: uvicorn's server with the shutdown a supervisor's SIGTERM expects of rollout-serve.

On SIGTERM or SIGINT: the listening socket closes (no new connections) and idle keep-alive
connections close; the requests in flight run on for up to `--shutdown-drain-s`; what is still
running then is aborted with SHUTDOWN_MESSAGE, so every client gets its exact partial output and
routing (finish_reason abort) and every stream ends with an error event and [DONE]. A second
signal ends the drain at once. Unlike uvicorn's own server, the signal is not raised again at the
end (that killed the process before main() could remove its files): main() cleans up and exits
0 after SIGTERM, 130 after SIGINT.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from typing import Any, Iterator, Optional

import uvicorn

from rollout.server.http_io import error_body

logger = logging.getLogger("rollout.server")

SHUTDOWN_MESSAGE = "the server is shutting down"
ABORT_FLUSH_S = 10.0      # after the aborts: how long the answers may take to be written
EXIT_CODES = {signal.SIGTERM: 0, signal.SIGINT: 130}


class ShutdownState:
    """Whether the shutdown has aborted the requests in flight: their streams end with an error event."""

    def __init__(self) -> None:
        self.aborted = False

    def error_for(self, out: Any) -> Optional[dict]:
        """The error event that ends the stream of `out` (None unless the shutdown aborted it)."""
        if not self.aborted or out.finish_reason != "abort":
            return None
        return error_body(f"{SHUTDOWN_MESSAGE}: the request was aborted (its partial output is above)",
                          "server_error", code=503)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, *, engine: Any, drain_s: float, state: ShutdownState):
        super().__init__(config)
        self.engine = engine
        self.state = state
        self.drain_s = drain_s
        self.signal: Optional[int] = None     # the first signal received
        self._hurry = False

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signal, 0)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in EXIT_CODES}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.signal is None:
            self.signal = sig
            logger.warning("%s: draining the requests in flight (at most %g s), then aborting the rest",
                           signal.Signals(sig).name, self.drain_s)
        elif self.should_exit:
            self._hurry = True
        self.should_exit = True

    async def shutdown(self, sockets: Optional[list] = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()   # NOTE: idle ones close now, busy ones after their answer
        engine = self.engine
        deadline = time.monotonic() + self.drain_s
        while (engine.num_in_flight or self.server_state.tasks) and time.monotonic() < deadline and not self._hurry:
            await asyncio.sleep(0.05)
        self.state.aborted = True
        aborted: set[int] = set()
        deadline = time.monotonic() + ABORT_FLUSH_S
        while (self.server_state.connections or self.server_state.tasks) and time.monotonic() < deadline:
            # NOTE: again each round: a request still being parsed when the drain ended is submitted later
            if engine.is_alive:
                now = engine.abort_in_flight(SHUTDOWN_MESSAGE, aborted)
                if now:
                    logger.warning("aborting %d request(s) still in flight", len(now))
                aborted.update(now)
            await asyncio.sleep(0.02)
        for connection in list(self.server_state.connections):
            connection.shutdown()
        for task in list(self.server_state.tasks):
            task.cancel()
        for server in self.servers:
            await server.wait_closed()
        await self.lifespan.shutdown()
