"""SGLang's /generate: one GenerateCall per body, answered whole or as an SSE stream (GenerateStream)."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from rollout.frontend.api import Rollout
from rollout.frontend.engine_client import RidInFlightError
from rollout.server.args import ServerArgs
from rollout.frontend.async_generation import EngineStream
from rollout.server.generate_request import ERROR_PARAMS, GenerateCall, as_response
from rollout.server.generate_stream import GenerateStream
from rollout.server.request_body import IgnoredFields, OFF_LOOP_CHARS, read_json, TextBound
from rollout.server.metrics import Metrics
from rollout.server.responses import (ApiError, JSONBytesResponse, SSEResponse, dumps_bytes, large_answer,
                                     param_of)

RID_IN_FLIGHT = "rid_in_flight_error"   # the error type clients retry on (the rid's earlier try is not done)


def _engine_error(exc: ValueError, known: set[str]) -> ApiError:
    msg = str(exc)
    if isinstance(exc, RidInFlightError):
        return ApiError(400, msg, type=RID_IN_FLIGHT, param="rid")
    return ApiError(400, msg, param=param_of(msg, known))


def add_generate_routes(app: FastAPI, *, engine: Rollout, args: ServerArgs, metrics: Metrics,
                        ignored: IgnoredFields, blocking: Callable[..., Awaitable[Any]], shutdown: Any) -> None:
    info = engine.info
    bound = TextBound(engine)

    def tokenize(texts: list[str]) -> list[list[int]]:
        return [engine.tokenizer.encode(t) for t in texts]

    def _texts(text: Any) -> list[str]:
        if isinstance(text, str):
            return [text]
        return [t for t in text if isinstance(t, str)] if isinstance(text, list) else []

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await read_json(request)
        texts = _texts(body.get("text"))
        bound.check(texts, "text", single=isinstance(body.get("text"), str))
        if sum(len(t) for t in texts) > OFF_LOOP_CHARS:
            call = await blocking(parse_generate, body)
        else:
            call = parse_generate(body)
        try:
            es = EngineStream(engine, call.args)
        except ValueError as exc:
            err = _engine_error(exc, ERROR_PARAMS)
            if body.get("text") is not None and err.param == "input_ids":
                err.param, err.message = "text", "text" + err.message.removeprefix("input_ids")
            raise err from None
        decode = lambda t: engine.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
        if not call.stream:
            outs = await es.outputs(request)
            metrics.finished(outs)

            def encode() -> tuple[bytes, list[int]]:
                answer = as_response(call, outs, es.submission.prompt_index, decode)
                items = answer if isinstance(answer, list) else [answer]
                sizes = [len(i["meta_info"]["routed_experts"]) for i in items if "routed_experts" in i["meta_info"]]
                if not isinstance(answer, list):
                    return dumps_bytes(answer), sizes
                # NOTE: one orjson call per item: a call holds the GIL for its whole length
                return b"[" + b",".join(dumps_bytes(i) for i in items) + b"]", sizes

            # NOTE: a large answer is built on a worker thread, so the loop keeps serving while it is encoded
            data, sizes = await blocking(encode) if large_answer(outs) else encode()
            for size in sizes:
                metrics.routing_bytes(call.fmt, size)
            return JSONBytesResponse(data)
        stream = GenerateStream(call, es, engine=engine, metrics=metrics, decode=decode, shutdown=shutdown)
        return SSEResponse(stream.events(), es.close)

    def parse_generate(body: dict) -> GenerateCall:
        return GenerateCall.parse(body, ignored, tokenize=tokenize,
                                  incremental_default=args.incremental_streaming_output, num_experts=info.num_experts,
                                  routing_default=args.default_return_routed_experts)
