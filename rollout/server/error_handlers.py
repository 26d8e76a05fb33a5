"""The exception handlers of rollout-serve: every error becomes a JSON answer in the shape its
endpoint's clients read ({"error": {...}}; the weight endpoints add SGLang's {"success": false, "message"})."""
from __future__ import annotations

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from rollout.frontend.api import EngineDeadError
from rollout.frontend.engine_client import WeightsInconsistentError
from rollout.server.args import ServerArgs
from rollout.frontend.async_generation import ClientGone
from rollout.server.guard import WEIGHT_PATHS, BodyTooLarge
from rollout.server.http_io import ApiError, error_body, json_response
from rollout.server.weight_updater import WeightUpdateError


def add_error_handlers(app: FastAPI, args: ServerArgs) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        body = error_body(exc.message, exc.type, exc.param, exc.status)
        if request.url.path in WEIGHT_PATHS:  # SGLang's shape too, so weight clients can read `success`
            body.update(success=False, message=exc.message)
        return json_response(body, exc.status)

    @app.exception_handler(WeightUpdateError)
    async def _weight_error(request: Request, exc: WeightUpdateError) -> Response:
        return json_response({"success": False, "message": str(exc),
                              **error_body(str(exc), code=exc.status)}, exc.status)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge) -> Response:
        return json_response(error_body(f"request body exceeds --max-request-bytes={args.max_request_bytes}",
                                        code=413), 413)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return json_response(error_body(f"{exc.detail}: {request.method} {request.url.path}"[:300],
                                        "not_found_error" if exc.status_code == 404 else "invalid_request_error",
                                        code=exc.status_code), exc.status_code)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> Response:
        return json_response(error_body(str(exc), "server_error", code=503), 503)

    @app.exception_handler(WeightsInconsistentError)
    async def _inconsistent(request: Request, exc: WeightsInconsistentError) -> Response:
        return json_response(error_body(str(exc), "server_error", code=503), 503)

    # NOTE: a client gone while its body was read (Starlette's ClientDisconnect) is no bug to log: 200
    # partial-body connections closing at once spent ~300 ms of the loop formatting their tracebacks
    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)
