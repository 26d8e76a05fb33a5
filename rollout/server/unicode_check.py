"""Request bodies must hold valid Unicode: JSON's `\\ud800` escape parses into a lone UTF-16
surrogate, a Python str that cannot be encoded, tokenized or written back out. One generic check,
on the parsed body, before any work is done."""
from __future__ import annotations

from typing import Any, Optional


def _valid(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def invalid_unicode_field(obj: Any, path: str = "") -> Optional[tuple[str, str]]:
    """(field path, what is wrong) for the first string, or field name, in a parsed JSON value that
    is not valid Unicode; None when every string is valid. Paths read like `sampling_params.stop[1]`."""
    stack: list[tuple[Any, str]] = [(obj, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not _valid(value):
                return where or "body", f"{where or 'the body'} is not valid Unicode (a lone UTF-16 surrogate)"
        elif isinstance(value, dict):
            for key, item in value.items():
                name = f"{where}.{key}" if where else key
                if not _valid(key):
                    shown = ascii(key)
                    return (f"{where}.{shown}" if where else shown,
                            f"field name {shown}{' in ' + where if where else ''} is not valid Unicode "
                            f"(a lone UTF-16 surrogate)")
                stack.append((item, name))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(value))
    return None


def body_may_hold_surrogates(raw: bytes) -> bool:
    """Cheap test on the raw body: a lone surrogate can only come from a `\\u` escape (the bytes
    themselves already decoded as UTF-8)."""
    return b"\\u" in raw
