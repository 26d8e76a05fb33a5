"""HTTP bodies in and out, as every endpoint reads and answers them.

Reading a request: the body as a JSON object (read_json, or the 400 that says what is wrong with
it), its keys screened by the endpoint's FieldPolicy (fields this server does not know are accepted
and ignored as SGLang ignores them, each logged once per endpoint and name and counted for /metrics
by IgnoredFields), and its prompt texts bounded before they are tokenized.

TextBound: the cheap length check a prompt text passes before it is tokenized, and tokenization
of long texts off the event loop.

A text longer than context_length * the tokenizer's longest token (in characters) cannot fit the
context whatever it encodes to, so it is refused at once with a 400 naming its field, without
tokenizing (tokenizing 30 MB took ~4 GB and minutes). Shorter texts past OFF_LOOP_CHARS are
tokenized on a worker thread, without the GIL (rollout/tokenizer.py), so the loop keeps serving.

The JSON and SSE answers every endpoint shares: the error shape ({"error": {"message", "type",
"param", "code"}}, raised as ApiError), compact JSON rendering and the event-stream response.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable, Optional, Sequence, Union

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from capture.codec import RoutedExpertsFormat
from rollout.server.piecewise_json import piecewise_loads
from rollout.server.unicode_check import body_may_hold_surrogates, invalid_unicode_field

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


logger = logging.getLogger("rollout.server")
MAX_TRACKED_NAMES = 256   # NOTE: names come from clients: bound the metric's label set
MAX_NAME_CHARS = 64
LARGE_BODY_BYTES = 1 << 20   # bodies past this are parsed on a worker thread, long strings in pieces


def _loads(raw: bytes | bytearray) -> Any:
    if len(raw) > LARGE_BODY_BYTES:
        try:
            return piecewise_loads(raw)
        except ValueError:
            pass   # NOTE: parsed whole below: the same result, or the same error, as a small body's
    return orjson.loads(raw)


def parse_json_body(raw: bytes | bytearray, *, allow_empty: bool = False) -> dict:
    """The body as a JSON object, or ApiError(400)."""
    if not raw or (raw[:1].isspace() and not raw.strip()):
        if allow_empty:
            return {}
        raise ApiError(400, "the request body must be a JSON object")
    try:
        obj = _loads(raw)
    except orjson.JSONDecodeError:
        # NOTE: what orjson refuses and the standard library reads (NaN literals, numbers past a
        # double's range, escaped lone surrogates) gets the standard library's reading, so that
        # validation names the field; malformed JSON gets its message. orjson reads an integer
        # over 64 bits as a float: no field accepts one, and the 400 names the same field.
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"malformed JSON body: {exc}"[:300]) from None
        # NOTE: only the standard library lets a lone surrogate through (orjson refuses them)
        if body_may_hold_surrogates(raw):
            bad = invalid_unicode_field(obj)
            if bad is not None:
                raise ApiError(400, f"{bad[1]}; every string must be valid Unicode", param=bad[0])
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return obj


async def read_body(request: Request) -> bytearray:
    """The body, gathered as it arrives (Request.body() joins its pieces at the end: one copy of the
    whole body on the loop, ~20 ms for 30 MB)."""
    raw = bytearray()
    async for piece in request.stream():
        raw += piece
    return raw


async def read_json(request: Request, *, allow_empty: bool = False) -> dict:
    raw = await read_body(request)
    if len(raw) > LARGE_BODY_BYTES:
        # NOTE: off the loop, and in pieces (piecewise_json): orjson holds the GIL while it parses
        return await asyncio.to_thread(parse_json_body, raw, allow_empty=allow_empty)
    return parse_json_body(raw, allow_empty=allow_empty)


def _label(name: str) -> str:
    name = name[:MAX_NAME_CHARS]
    return "".join(c if c.isalnum() or c in "._-" else "?" for c in name)


class IgnoredFields:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter = Counter()

    def note(self, endpoint: str, name: str) -> None:
        key = (endpoint, _label(str(name)))
        with self._lock:
            if key not in self._counts and len(self._counts) >= MAX_TRACKED_NAMES:
                key = (endpoint, "<other>")
            first = key not in self._counts
            self._counts[key] += 1
        if first:
            logger.warning("%s: ignoring unknown request field %r (logged once; counted in /metrics as "
                           "rollout_ignored_fields_total)", endpoint, key[1])

    def samples(self) -> list[tuple[str, str, int]]:
        with self._lock:
            return [(e, n, c) for (e, n), c in sorted(self._counts.items())]


def is_null(value: Any) -> bool:
    """What 'not asking for the feature' looks like in JSON: null, false, [] or {}."""
    return value is None or value is False or (isinstance(value, (list, dict)) and not value)


@dataclass(frozen=True, kw_only=True)
class FieldPolicy:
    """acted: fields this server implements (validated where used); accepted: SGLang fields that do
    not change the result here (taken as they are); only_null: SGLang fields that would change the
    result and are not implemented: null/false/empty passes, anything else is a 400 naming the
    field. Every other key is unknown: ignored, logged once and counted."""

    endpoint: str
    acted: frozenset[str]
    accepted: frozenset[str] = frozenset()
    only_null: frozenset[str] = frozenset()
    prefix: str = ""

    def screen(self, body: dict, ignored: IgnoredFields) -> dict:
        """The acted-on fields of body (raises ApiError on a refused value)."""
        kept = {}
        for key, value in body.items():
            if key in self.acted:
                kept[key] = value
            elif key in self.accepted:
                continue
            elif key in self.only_null:
                if not is_null(value):
                    raise ApiError(400, f"{self.prefix}{key} is not supported by this server (only null or "
                                        f"false is accepted)", param=f"{self.prefix}{key}")
            else:
                ignored.note(self.endpoint, f"{self.prefix}{key}")
        return kept

    @property
    def names(self) -> Iterable[str]:
        return self.acted | self.accepted | self.only_null


OFF_LOOP_CHARS = 20000   # texts longer than this (in all) are tokenized on a worker thread


class TextBound:
    def __init__(self, engine: Any):
        self.engine = engine

    def check_length(self, chars: int, name: str, field: str) -> None:
        """ApiError(400, param=field) when `chars` characters cannot fit the context (Tokenizer.check_length)."""
        try:
            self.engine.tokenizer.check_length(chars, name, self.engine.context_length)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=field) from None

    def check(self, texts: Sequence[str], field: str, *, single: bool = False) -> None:
        """ApiError(400, param=field) for the first text that cannot fit the context."""
        for i, text in enumerate(texts):
            self.check_length(len(text), field if single else f"{field}[{i}]", field)

    async def tokenize(self, texts: Sequence[str], field: str, *, single: bool = False) -> list[list[int]]:
        """Each text's token ids, after the length check; long texts on a worker thread."""
        self.check(texts, field, single=single)
        encode = self.engine.tokenizer.encode
        if sum(len(t) for t in texts) <= OFF_LOOP_CHARS:
            return [encode(t) for t in texts]
        return await asyncio.to_thread(lambda: [encode(t) for t in texts])


def typed(body: dict, name: str, types: tuple, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise ApiError(400, f"{name} has the wrong type ({type(value).__name__})", param=name)
    return value


def routing_format(value: Any) -> str:
    """routed_experts_format (None: int32), or the 400 naming the allowed formats."""
    try:
        return "int32" if value is None else RoutedExpertsFormat.parse(value).value
    except ValueError as exc:
        raise ApiError(400, str(exc), param="routed_experts_format") from None
