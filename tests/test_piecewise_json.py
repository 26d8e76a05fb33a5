"""piecewise_loads (large request bodies parsed in pieces off the loop) equals orjson.loads, whatever
the escapes, non-ASCII text and surrogate pairs at the cuts; what it cannot take falls back whole."""
import json
import random

import orjson
import pytest

from rollout.server.piecewise_json import piecewise_loads
from rollout.server.http_io import ApiError, parse_json_body

ALPHABET = ["a", "b", "0", "f", " ", "\n", "\t", '"', "\\", "/", "\u00e9", "\u4e2d", "\U0001F600", "\x01", "u"]


def _text(rng, n):
    return "".join(rng.choice(ALPHABET) for _ in range(n))


@pytest.mark.parametrize("seed", range(12))
def test_equals_orjson_with_cuts_everywhere(seed):
    rng = random.Random(seed)
    body = {"text": _text(rng, rng.randrange(200, 3000)), "sampling_params": {"stop": [_text(rng, 5)]},
            "batch": [_text(rng, rng.randrange(0, 900)) for _ in range(3)], _text(rng, 400): [1, 2.5, None, True],
            "nested": [{"k": _text(rng, 700)}]}
    for ensure_ascii in (True, False):
        raw = json.dumps(body, ensure_ascii=ensure_ascii).encode()
        for piece in (7, 8, 13, 64, 1000):
            assert piecewise_loads(raw, long_bytes=16, piece_bytes=piece) == orjson.loads(raw) == body


def test_a_whole_body_that_is_one_long_string_and_no_long_string():
    raw = json.dumps("x\\y" * 500).encode()
    assert piecewise_loads(raw, long_bytes=10, piece_bytes=17) == "x\\y" * 500
    raw = json.dumps({"input_ids": list(range(1000))}).encode()
    assert piecewise_loads(raw, long_bytes=10, piece_bytes=17) == {"input_ids": list(range(1000))}


@pytest.mark.parametrize("raw", [b'{"text": "' + b"\\\\" * 5000 + b'"}',           # no safe cut: escapes only
                                 b'{"text": "' + b"a" * 600 + b'\\ud800"}',        # a lone surrogate
                                 b'{"text": "' + b"a" * 600,                       # unterminated
                                 b'{"text": "' + b"a" * 600 + b'", "x": NaN}'])    # orjson refuses NaN
def test_what_it_cannot_take_is_a_value_error(raw):
    with pytest.raises(ValueError):
        piecewise_loads(raw, long_bytes=16, piece_bytes=32)


def test_large_bodies_read_as_small_ones(monkeypatch):
    import rollout.server.piecewise_json as pj

    monkeypatch.setattr("rollout.server.http_io.LARGE_BODY_BYTES", 64)
    monkeypatch.setattr(pj, "LONG_STRING_BYTES", 16)
    monkeypatch.setattr(pj, "PIECE_BYTES", 32)
    text = "caf\u00e9 \U0001F600 " * 40
    assert parse_json_body(json.dumps({"text": text}).encode()) == {"text": text}
    assert parse_json_body(json.dumps({"text": text, "t": float("nan")}).encode())["text"] == text
    with pytest.raises(ApiError) as err:                 # the standard library's reading names the field
        parse_json_body(b'{"text": "' + b"a" * 600 + b'", "stop": ["\\ud800"]}')
    assert err.value.param == "stop[0]" and "not valid Unicode" in err.value.message
    with pytest.raises(ApiError, match="malformed JSON body"):
        parse_json_body(b'{"text": "' + b"a" * 600)
    with pytest.raises(ApiError, match="must be a JSON object"):
        parse_json_body(json.dumps([text]).encode())
    assert parse_json_body(b"  \n", allow_empty=True) == {}
