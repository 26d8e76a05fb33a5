"""trim_heap: glibc's malloc_trim(0) after a large request, so that the heap pages its copies (a 30 MB
body, its parsed strings, a 57 MB answer) used go back to the OS instead of staying in RSS (measured
with scripts/bench_hostile.py: +34 MB after a refused 30 MB text and +53 MB after a 30 MB chat
message without it, +17 MB and +0 with it). Elsewhere than glibc it does nothing."""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable, Optional

TRIM_AFTER_BYTES = 1 << 20   # a request whose body or answer is larger is followed by a trim


def _malloc_trim() -> Optional[Callable[[int], int]]:
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Free heap memory back to the OS (True if some was); ctypes drops the GIL during the call."""
    return bool(_TRIM(0)) if _TRIM is not None else False
