"""Guard: API-key levels (user, admin) and the request body size limit, as pure ASGI middleware
(so it covers streaming responses too); it also counts every answer's status for /metrics."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any, Callable, Optional

from rollout.server.args import ServerArgs
from rollout.server.heap_trim import TRIM_AFTER_BYTES, trim_heap
from rollout.server.metrics import Metrics
from rollout.server.responses import error_body

WEIGHT_PATHS = frozenset({"/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
                          "/update_weights_from_distributed", "/destroy_weights_update_group",
                          "/update_weight_version", "/begin_weight_update", "/end_weight_update"})
ADMIN_PATHS = WEIGHT_PATHS | {"/pause_generation", "/continue_generation", "/flush_cache", "/debug/integrity",
                              "/release_memory_occupation", "/resume_memory_occupation"}
PUBLIC_PATHS = frozenset({"/health"})
logger = logging.getLogger("rollout.server")


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
