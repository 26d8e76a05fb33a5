"""Reading a request: the body as a JSON object (read_json, or the 400 that says what is wrong with
it), its keys screened by the endpoint's FieldPolicy (fields this server does not know are accepted
and ignored as SGLang ignores them, each logged once per endpoint and name and counted for /metrics
by IgnoredFields), and its prompt texts bounded before they are tokenized.

TextBound: the cheap length check a prompt text passes before it is tokenized, and tokenization
of long texts off the event loop.

A text longer than context_length * the tokenizer's longest token (in characters) cannot fit the
context whatever it encodes to, so it is refused at once with a 400 naming its field, without
tokenizing (tokenizing 30 MB took ~4 GB and minutes). Shorter texts past OFF_LOOP_CHARS are
tokenized on a worker thread, without the GIL (rollout/tokenizer.py), so the loop keeps serving.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import orjson
from starlette.requests import Request

from rollout.server.piecewise_json import piecewise_loads
from rollout.server.responses import ApiError
from rollout.server.unicode_check import body_may_hold_surrogates, invalid_unicode_field

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
