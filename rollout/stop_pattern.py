"""compile_stop_pattern: a `stop_regex` compiled with RE2, whose matching time is linear in the text.

Python's `re` backtracks: one pattern such as `([\\s\\S]+)+\\x00` takes exponential time on a text it
does not match, and a match cannot be interrupted (it holds the GIL inside C code), so a time
budget cannot bound it. RE2 matches in time linear in the text for every pattern it accepts; the
patterns it refuses (backreferences, lookaround, possessive quantifiers, `\\Z`) get a ValueError
naming `stop_regex`, as do patterns whose automaton would exceed RE2's memory budget.
"""
from __future__ import annotations

from typing import Any

import re2

# NOTE: RE2's default program budget (8 MiB): `(a{100}){100}`-sized patterns are refused at compile
_MAX_MEM = 8 << 20


def _options() -> Any:
    opts = re2.Options()
    opts.log_errors = False          # NOTE: otherwise every refused pattern is logged to stderr by RE2 itself
    opts.max_mem = _MAX_MEM
    return opts


def compile_stop_pattern(pattern: str) -> Any:
    """The compiled pattern (`.search(text)` -> match with `.group(0)`, or None); ValueError when RE2
    cannot take it."""
    try:
        return re2.compile(pattern, _options())
    except re2.error as exc:
        detail = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(f"stop_regex {pattern!r} is not supported: {detail} (stop_regex runs on RE2, linear-time "
                         f"matching: no backreferences, lookaround, possessive quantifiers or \\Z)"[:400]) from None
