"""The JSON and SSE answers every endpoint shares: the error shape ({"error": {"message", "type",
"param", "code"}}, raised as ApiError), compact JSON rendering and the event-stream response."""
from __future__ import annotations

import json
import math
import re
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Union

import orjson
from starlette.responses import Response, StreamingResponse


class ApiError(Exception):
    """An HTTP error answered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param

    def response(self) -> Response:
        return json_response(error_body(self.message, self.type, self.param, self.status), self.status)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[int] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_FIELD = re.compile(r"^(?:sampling_params\.)?([A-Za-z_][A-Za-z0-9_]*)")


def param_of(message: str, known: set[str]) -> Optional[str]:
    """The request field an engine ValueError message starts with (its convention), if known."""
    m = _FIELD.match(message)
    return m.group(1) if m and m.group(1) in known else None


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON; non-finite floats (e.g. -inf top logprobs) become null, as in SGLang.
    orjson (several times faster than the standard library on logprob lists) writes NaN and
    infinities as null itself; what it cannot encode (an integer over 64 bits) takes the standard
    library's path."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:
        return json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


LARGE_ANSWER_ENTRIES = 20000   # token and top-logprob entries past which an answer is built off the loop


def large_answer(outs: Sequence[Any]) -> bool:
    """Whether building and encoding these outputs' answer belongs on a worker thread (n = 128 with
    top-20 logprobs and routing: ~57 MB of JSON)."""
    return len(outs) > 8 or sum(len(o.output_ids) * (1 + (len(o.output_top_logprobs[0]) if o.output_top_logprobs
                                                          else 0)) for o in outs) > LARGE_ANSWER_ENTRIES


SEND_PIECE_BYTES = 1 << 20   # a larger answer is written in pieces of this size


class JSONBytesResponse(Response):
    """An encoded JSON answer, written in pieces: one write of a 57 MB answer (n = 128, top-20
    logprobs, routing) held the loop ~50 ms copying it into the transport's buffer; between pieces
    the transport's flow control lets the loop serve others."""

    media_type = "application/json"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = self.body
        if len(body) <= SEND_PIECE_BYTES:
            return await super().__call__(scope, receive, send)
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for start in range(0, len(body), SEND_PIECE_BYTES):
            end = start + SEND_PIECE_BYTES
            await send({"type": "http.response.body", "body": body[start:end], "more_body": end < len(body)})


def json_response(obj: Any, status: int = 200) -> Response:
    return JSONBytesResponse(dumps_bytes(obj), status_code=status)


def sse(obj: Any) -> bytes:
    """One server-sent event (bytes: StreamingResponse would encode a str again)."""
    return b"data: " + dumps_bytes(obj) + b"\n\n"


class SSEResponse(StreamingResponse):
    """text/event-stream that runs on_close however the response ends (done, error, disconnect)."""

    def __init__(self, body: AsyncIterator[Union[str, bytes]], on_close: Callable[[], None]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

