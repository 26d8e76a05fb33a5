"""read_json: a request body as a JSON object, or the 400 that says what is wrong with it."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
from starlette.requests import Request

from rollout.server.piecewise_json import piecewise_loads
from rollout.server.responses import ApiError
from rollout.server.unicode_check import body_may_hold_surrogates, invalid_unicode_field

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
