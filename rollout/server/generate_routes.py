"""SGLang's /generate: one GenerateCall per body, answered whole or as an SSE stream (GenerateStream)."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from rollout.frontend.api import Rollout
from rollout.frontend.engine_client import RidInFlightError
from rollout.server.args import ServerArgs
from rollout.server.engine_stream import EngineStream
from rollout.server.generate_request import ERROR_PARAMS, GenerateCall, as_response
from rollout.server.generate_stream import GenerateStream
from rollout.server.ignored_fields import IgnoredFields
from rollout.server.metrics import Metrics
from rollout.server.request_body import read_json
from rollout.server.responses import ApiError, SSEResponse, json_response, param_of

RID_IN_FLIGHT = "rid_in_flight_error"   # the error type clients retry on (the rid's earlier try is not done)


def _engine_error(exc: ValueError, known: set[str]) -> ApiError:
    msg = str(exc)
    if isinstance(exc, RidInFlightError):
        return ApiError(400, msg, type=RID_IN_FLIGHT, param="rid")
    return ApiError(400, msg, param=param_of(msg, known))


def add_generate_routes(app: FastAPI, *, engine: Rollout, args: ServerArgs, metrics: Metrics,
                        ignored: IgnoredFields, blocking: Callable[..., Awaitable[Any]]) -> None:
    info = engine.info

    def tokenize(texts: list[str]) -> list[list[int]]:
        return [engine.tokenizer.encode(t) for t in texts]

    def _texts(text: Any) -> list[str]:
        if isinstance(text, str):
            return [text]
        return [t for t in text if isinstance(t, str)] if isinstance(text, list) else []

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await read_json(request)
        if sum(len(t) for t in _texts(body.get("text"))) > 20000:
            call = await blocking(parse_generate, body)
        else:
            call = parse_generate(body)
        try:
            es = EngineStream(engine, **call.kwargs)
        except ValueError as exc:
            err = _engine_error(exc, ERROR_PARAMS)
            if body.get("text") is not None and err.param == "input_ids":
                err.param = "text"
            raise err from None
        decode = lambda t: engine.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
        if not call.stream:
            outs = await es.outputs(request)
            metrics.finished(outs)
            answer = as_response(call, outs, es.submission.prompt_index, decode)
            for item in answer if isinstance(answer, list) else [answer]:
                if "routed_experts" in item["meta_info"]:
                    metrics.routing_bytes(call.fmt, len(item["meta_info"]["routed_experts"]))
            return json_response(answer)
        stream = GenerateStream(call, es, engine=engine, metrics=metrics, decode=decode)
        return SSEResponse(stream.events(), es.close)

    def parse_generate(body: dict) -> GenerateCall:
        return GenerateCall.parse(body, ignored, tokenize=tokenize,
                                  incremental_default=args.incremental_streaming_output, num_experts=info.num_experts,
                                  routing_default=args.default_return_routed_experts)
