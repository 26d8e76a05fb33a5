"""The OpenAI-style routes (/v1/completions, /v1/chat/completions, /v1/models) over OpenAIServing."""
from __future__ import annotations

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from rollout.server.openai_serving import OpenAIServing
from rollout.server.http_io import json_response, read_json


def add_openai_routes(app: FastAPI, openai: OpenAIServing) -> None:
    @app.post("/v1/completions")
    async def v1_completions(request: Request) -> Response:
        return await openai.completions(await read_json(request), request)

    @app.post("/v1/chat/completions")
    async def v1_chat(request: Request) -> Response:
        return await openai.chat(await read_json(request), request)

    @app.get("/v1/models")
    async def v1_models() -> Response:
        return json_response(openai.models())
