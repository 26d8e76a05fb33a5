"""The client's error types, and how a server's error answer maps to them.

Public: ``RolloutError`` (a request could not be completed), ``NoServerError``, ``RequestRejected``
(4xx: never retried), ``SampleError`` (a response failed validation). Internal: ``_ServerFailed``
(one attempt failed on one server: retried elsewhere) and ``_Aborted`` (aborted by someone else:
submitted again).

The client decides on HTTP status and on the JSON error body's ``type`` (docs/protocol.md:
``{"error": {"message", "type", "param", "code"}}``), never on the wording of a message.
"""
from __future__ import annotations

import json
from typing import Optional

RETRY_STATUS = {500, 502, 503, 504}
RID_IN_FLIGHT = "rid_in_flight_error"   # the server's error type for a rid still in flight (docs/protocol.md)


class RolloutError(RuntimeError):
    """A request could not be completed."""


class NoServerError(RolloutError):
    """No live server is left (or every attempt failed)."""


class RequestRejected(ValueError):
    """A server answered 4xx: the request itself is wrong (never retried)."""


class SampleError(ValueError):
    """A response failed validation (names the rid and the server)."""


class _ServerFailed(Exception):
    def __init__(self, message: str, *, dead: bool):
        super().__init__(message)
        self.dead = dead


class _Aborted(Exception):
    """A server returned the request aborted by someone else (pause/abort_all): submit it again."""


def check_status(url: str, rid: str, status: int, text: str) -> None:
    """Raise for an HTTP error answer to ``/generate``: ``_ServerFailed`` when another try (on
    another server) may succeed, ``RequestRejected`` when the request itself is wrong."""
    if status < 400:
        return
    if status in RETRY_STATUS:
        raise _ServerFailed(f"HTTP {status}: {text[:200]}", dead=status == 503)
    if status == 400 and error_type(text) == RID_IN_FLIGHT:  # NOTE: our abort of a timed-out try is not done yet
        raise _ServerFailed(f"HTTP 400: {text[:200]}", dead=False)
    raise RequestRejected(f"request {rid!r} rejected by {url}: HTTP {status}: {text[:500]}")


def error_type(text: str) -> Optional[str]:
    """The `error.type` of a JSON error body, if it is one."""
    try:
        body = json.loads(text)
    except ValueError:
        return None
    err = body.get("error") if isinstance(body, dict) else None
    return err.get("type") if isinstance(err, dict) else None
