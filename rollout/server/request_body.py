"""read_json: a request body as a JSON object, or the 400 that says what is wrong with it."""
from __future__ import annotations

import json

import orjson
from starlette.requests import Request

from rollout.server.responses import ApiError
from rollout.server.unicode_check import body_may_hold_surrogates, invalid_unicode_field


async def read_json(request: Request, *, allow_empty: bool = False) -> dict:
    raw = await request.body()
    if not raw.strip():
        if allow_empty:
            return {}
        raise ApiError(400, "the request body must be a JSON object")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        # NOTE: what orjson refuses and the standard library reads (NaN literals, numbers past a
        # double's range, escaped lone surrogates) gets the standard library's reading, so that
        # validation names the field; malformed JSON gets its message. orjson reads an integer
        # over 64 bits as a float: no field accepts one, and the 400 names the same field.
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"malformed JSON body: {exc}"[:300]) from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body_may_hold_surrogates(raw):
        bad = invalid_unicode_field(obj)
        if bad is not None:
            raise ApiError(400, f"{bad[1]}; every string must be valid Unicode", param=bad[0])
    return obj
