"""What a connection and a request pass before the app.

Guard: API-key levels (user, admin) and the request body size limit, as pure ASGI middleware
(so it covers streaming responses too); it also counts every answer's status for /metrics.

timed_protocol(): uvicorn's httptools HTTP/1.1 protocol with read deadlines (slowloris).

uvicorn times out only idle keep-alive connections (after an answer): a connection that never sends
a byte, or sends a request's headers or body a byte at a time, stayed open indefinitely (19,900 such
connections took a server to its file-descriptor limit). Here a connection closes when:
  - it opened and sent no complete request headers within `timeout_s`;
  - a request's first byte arrived and its headers did not complete within `timeout_s`;
  - its headers completed and its body did not within `timeout_s`.
A request whose headers are in is being answered: the application reads its body; if the body then
misses its deadline, the connection closes and the application sees the client disconnect.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any, Callable, Optional

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rollout.server.args import ServerArgs
from rollout.host_malloc import trim_heap
from rollout.server.metrics import Metrics
from rollout.server.http_io import error_body

WEIGHT_PATHS = frozenset({"/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
                          "/update_weights_from_distributed", "/destroy_weights_update_group",
                          "/update_weight_version", "/begin_weight_update", "/end_weight_update"})
ADMIN_PATHS = WEIGHT_PATHS | {"/pause_generation", "/continue_generation", "/flush_cache", "/debug/integrity",
                              "/release_memory_occupation", "/resume_memory_occupation"}
PUBLIC_PATHS = frozenset({"/health"})
logger = logging.getLogger("rollout.server")

# NOTE: a request whose body or answer is larger is followed by glibc's malloc_trim(0), so the heap
# pages its copies used go back to the OS (scripts/bench_hostile.py: +34 MB after a refused 30 MB
# text and +53 MB after a 30 MB chat message without it, +17 MB and +0 with it)
TRIM_AFTER_BYTES = 1 << 20


class BodyTooLarge(Exception):
    pass


class Guard:
    def __init__(self, app: Any, args: ServerArgs, metrics: Metrics):
        self.app = app
        self.api_key = args.api_key.encode() if args.api_key else None
        self.admin_key = args.admin_api_key.encode() if args.admin_api_key else None
        self.max_bytes = args.max_request_bytes
        self.metrics = metrics

    @staticmethod
    async def _reply(send: Callable, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    def _level(self, headers: dict) -> Optional[str]:
        auth = headers.get(b"authorization", b"")
        if not auth.lower().startswith(b"bearer "):
            return None
        token = auth[7:].strip()
        if self.admin_key is not None and hmac.compare_digest(token, self.admin_key):
            return "admin"
        if self.api_key is not None and hmac.compare_digest(token, self.api_key):
            return "user"
        return None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        status_box = [0]
        sizes = [0, 0]   # body bytes received, answer bytes sent

        async def receive_counted() -> dict:
            message = await receive()
            sizes[0] += len(message.get("body", b""))
            return message

        async def send_tracked(message: dict) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            sizes[1] += len(message.get("body", b""))
            await send(message)

        try:
            await self._handle(scope, receive_counted, send_tracked, path)
        except Exception as exc:  # noqa: BLE001 (the handlers' bugs: a JSON 500, the connection kept)
            logger.error("internal error on %s", path, exc_info=exc)
            if status_box[0]:
                raise   # NOTE: the answer has begun: uvicorn closes the connection (nothing else can end it)
            status_box[0] = 500
            # NOTE: answered here, not re-raised: Starlette's ServerErrorMiddleware re-raises after its
            # 500 and uvicorn then closes the keep-alive connection, failing the client's next request
            await self._reply(send, 500, error_body(f"internal error: {type(exc).__name__}", "server_error", code=500))
        finally:
            self.metrics.request(path, status_box[0])
        if max(sizes) > TRIM_AFTER_BYTES:
            await asyncio.to_thread(trim_heap)   # NOTE: after the answer, when the request's copies are freed

    async def _handle(self, scope: dict, receive: Callable, send: Callable, path: str) -> None:
        headers = dict(scope.get("headers") or [])
        level = self._level(headers)
        scope.setdefault("state", {})["auth_level"] = level
        if path not in PUBLIC_PATHS:
            if path in ADMIN_PATHS and self.admin_key is not None:
                if level != "admin":
                    status = 403 if level == "user" else 401
                    msg = "this endpoint needs the admin API key" if status == 403 else "missing or wrong API key"
                    return await self._reply(send, status, error_body(msg, "authentication_error", code=status))
            elif self.api_key is not None and level is None:
                return await self._reply(send, 401, error_body("missing or wrong API key (Authorization: Bearer ...)",
                                                               "authentication_error", code=401))
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await self._reply(send, 400, error_body("invalid Content-Length", code=400))
            if int(length) > self.max_bytes:
                return await self._reply(send, 413, error_body(
                    f"request body of {int(length)} bytes exceeds --max-request-bytes={self.max_bytes}", code=413))
        seen = [0]

        async def limited_receive() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_bytes:
                    raise BodyTooLarge()
            return message

        await self.app(scope, limited_receive, send)


OVER_CAP_READ_S = 2.0   # a connection past the cap must send its request's headers within this


async def _over_capacity(scope: dict, receive: Callable, send: Callable) -> None:
    """The answer on a connection past --max-connections (JSON, and the connection closes)."""
    data = json.dumps(error_body("the server has too many open connections (--max-connections); retry later",
                                 "server_error", code=503)).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})


def timed_protocol(timeout_s: float, max_connections: Optional[int] = None) -> type:
    """An HttpToolsProtocol class whose reads must finish within timeout_s (uvicorn.Config(http=...));
    with max_connections, a connection opened past that many open ones is answered 503 (JSON) on its
    first request and closed, and gets OVER_CAP_READ_S to send it (its descriptor is freed soon)."""

    class TimedHttpToolsProtocol(HttpToolsProtocol):
        _deadline: Optional[asyncio.TimerHandle] = None
        _reading = False      # a request's headers or body are being read
        _over = False         # opened past max_connections

        def _arm(self) -> None:
            self._disarm()
            limit = min(timeout_s, OVER_CAP_READ_S) if self._over else timeout_s
            self._deadline = self.loop.call_later(limit, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._over = max_connections is not None and len(self.connections) > max_connections
            self._reading = True
            self._arm()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self._reading:       # the first byte of the next request on a kept-alive connection
                self._reading = True
                self._arm()
            super().data_received(data)

        def on_headers_complete(self) -> None:
            if self._over:
                app, self.app = self.app, _over_capacity
                try:
                    super().on_headers_complete()
                finally:
                    self.app = app
            else:
                super().on_headers_complete()
            self._arm()                 # the body's deadline (the request is answered from here on)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()   # NOTE: arms uvicorn's keep-alive timeout for the idle time
            self._reading = False

    return TimedHttpToolsProtocol
