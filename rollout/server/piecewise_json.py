"""piecewise_loads: a large JSON body parsed without holding the GIL for long, so that a worker thread
parsing it does not stall the event loop.

orjson holds the GIL for a whole `loads` (~65 ms for one 30 MB string; on a thread that is 65 ms of
the loop's time too). Here long string literals are cut out of the body first (a scan for quotes),
the rest (small) is parsed at once with a placeholder for each, and each long literal is decoded in
pieces of about `piece_bytes`, split only where no escape or UTF-8 sequence spans the cut; between
pieces the GIL goes back to the loop. The result equals `orjson.loads(raw)`; anything this path does
not handle (malformed JSON, no safe cut in a long run of escapes) raises ValueError and the caller
parses the body whole instead.
"""
from __future__ import annotations

import secrets
from typing import Any

import orjson

LONG_STRING_BYTES = 1 << 18   # literals longer than this are decoded in pieces
PIECE_BYTES = 1 << 20
_SEARCH_BYTES = 4096           # how far from a piece's end a safe cut is looked for
_BACKSLASH = 0x5C
_HIGH_SURROGATE_2ND = frozenset(b"89abAB")


def _closing_quote(raw: bytes, start: int) -> int:
    """Index of the quote that closes the literal opened at raw[start - 1]."""
    pos = start
    while True:
        q = raw.find(b'"', pos)
        if q < 0:
            raise ValueError("unterminated string")
        run = 0
        while raw[q - 1 - run] == _BACKSLASH:
            run += 1
        if run % 2 == 0:
            return q
        pos = q + 1


def _safe_cut(raw: bytes, p: int) -> bool:
    """A literal's content may be cut before raw[p]: no escape or UTF-8 sequence spans it."""
    if 0x80 <= raw[p] < 0xC0:
        return False
    if raw.find(b"\\", p - 6, p) < 0:
        return True
    # NOTE: before an escape that starts here (no backslash right before it), unless that would part
    # a surrogate pair (a high surrogate \uD8xx-\uDBxx right before)
    if raw[p] != _BACKSLASH or raw[p - 1] == _BACKSLASH:
        return False
    prev = raw[p - 6:p]
    return not (prev[:2] == b"\\u" and prev[2:3] in (b"d", b"D") and prev[3] in _HIGH_SURROGATE_2ND)


def _decode_literal(raw: bytes, start: int, end: int, piece_bytes: int) -> str:
    """The string of the literal whose content is raw[start:end], decoded piece by piece."""
    pieces = []
    pos = start
    while pos < end:
        cut = min(end, pos + piece_bytes)
        if cut < end:
            near = [*range(cut, max(pos, cut - 64), -1), *range(cut + 1, min(end, cut + _SEARCH_BYTES))]
            cut = next((p for p in near if _safe_cut(raw, p)), end if end - cut < _SEARCH_BYTES else None)
            if cut is None:
                raise ValueError("no safe cut in a long run of escapes")
        pieces.append(orjson.loads(b'"' + raw[pos:cut] + b'"'))
        pos = cut
    return "".join(pieces)


def _restore(obj: Any, long: dict[str, str]) -> Any:
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            for key in [k for k in value if k in long]:
                value[long[key]] = value.pop(key)
            for key, item in value.items():
                if isinstance(item, str) and item in long:
                    value[key] = long[item]
                elif isinstance(item, (dict, list)):
                    stack.append(item)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, str) and item in long:
                    value[i] = long[item]
                elif isinstance(item, (dict, list)):
                    stack.append(item)
    return long.get(obj, obj) if isinstance(obj, str) else obj


def piecewise_loads(raw: bytes, *, long_bytes: int = LONG_STRING_BYTES, piece_bytes: int = PIECE_BYTES) -> Any:
    """orjson.loads(raw), with long string literals decoded in pieces (ValueError: parse it whole)."""
    tag = secrets.token_hex(8)
    parts: list[bytes] = []
    long: dict[str, str] = {}
    done = pos = 0
    while True:
        q = raw.find(b'"', pos)
        if q < 0:
            break
        end = _closing_quote(raw, q + 1)
        if end - q - 1 > long_bytes:
            name = f"\x00{tag}:{len(long)}"
            long[name] = _decode_literal(raw, q + 1, end, piece_bytes)
            parts += [raw[done:q + 1], orjson.dumps(name)[1:-1]]
            done = end
        pos = end + 1
    if not long:
        return orjson.loads(raw)
    parts.append(raw[done:])
    try:
        return _restore(orjson.loads(b"".join(parts)), long)
    except orjson.JSONDecodeError as exc:
        raise ValueError(str(exc)) from None
