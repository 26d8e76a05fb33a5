"""IgnoredFields: request fields this server does not know, accepted and ignored as SGLang ignores
them, each logged once per endpoint and name and counted for /metrics; plus FieldPolicy, the
check every endpoint runs over a request body's keys."""
from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

from rollout.server.responses import ApiError

logger = logging.getLogger("rollout.server")
MAX_TRACKED_NAMES = 256   # NOTE: names come from clients: bound the metric's label set
MAX_NAME_CHARS = 64


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
