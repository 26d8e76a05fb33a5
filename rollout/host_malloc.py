"""Host allocator tuning for engines that compute on the CPU (glibc malloc).

glibc serves allocations above a dynamic threshold (128 KiB at start) with fresh mmap()s, whose
pages fault in zero-filled on first touch, and gives them back on free. A decode step's
temporaries (KV gathers, attention scores) grow with the context every step, so in a fresh
process nearly every step paid those page faults again: the first run of a workload took about
twice as long as the same run later in the process. Raising the mmap threshold to its maximum
(32 MiB on 64-bit) and the trim threshold keeps such buffers in the heap and reuses them. The
cost: freed memory up to the trim threshold stays with the process instead of going back to the
OS. No effect (and no error) on other C libraries.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20      # glibc's upper limit on 64-bit
TRIM_THRESHOLD_BYTES = 512 * 2**20


def tune_glibc_malloc() -> bool:
    """Sets the thresholds above for this process; True when glibc accepted them."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                 TRIM_THRESHOLD_BYTES))
    logger.debug("glibc malloc thresholds %s", "set" if ok else "not accepted")
    return ok
