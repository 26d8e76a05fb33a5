"""Host allocator tuning for engines that compute on the CPU (glibc malloc).

glibc serves allocations above a dynamic threshold (128 KiB at start) with fresh mmap()s, whose
pages fault in zero-filled on first touch, and gives them back on free. A decode step's
temporaries (KV gathers, attention scores) grow with the context every step, so in a fresh
process nearly every step paid those page faults again: the first run of a workload took about
twice as long as the same run later in the process. Raising the mmap threshold to its maximum
(32 MiB on 64-bit) and the trim threshold keeps such buffers in the heap and reuses them. The
cost: freed memory up to the trim threshold stays with the process instead of going back to the
OS. No effect (and no error) on other C libraries.

oneDNN, which runs torch's bfloat16 matmuls on CPUs that have the instructions for them, keeps
its JIT-compiled kernels in two caches keyed by the problem's shape (torch's ideep cache,
`LRU_CACHE_CAPACITY`, and oneDNN's primitive cache, `ONEDNN_PRIMITIVE_CACHE_CAPACITY`; 1024 entries
each by default, about 0.25 MB an entry). An eager engine's shapes change with every batch (token
counts, the busiest expert's rows), so both caches filled over hundreds of RL steps, about 500 MB
per engine process. Engine processes bound them to `ONEDNN_CACHE_ENTRIES` each unless the
environment sets them: kernels of the shapes used most stay cached, a rarer shape is compiled again
(about 3 ms).

Large, randomly gathered buffers (the KV pool) are also backed by transparent huge pages where
the kernel allows them on request (`madvise` mode, the usual default): every decode step gathers
each request's KV rows from all over the pool, and with 4 KiB pages those reads miss the TLB.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20      # glibc's upper limit on 64-bit
TRIM_THRESHOLD_BYTES = 512 * 2**20
_MADV_HUGEPAGE = 14                    # Linux
ONEDNN_CACHE_ENTRIES = 256
ONEDNN_CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
HUGE_PAGE_BYTES = 2 * 2**20


def _libc_function(name: str):
    """The C library's function `name`, or None where there is none (another C library, no libc)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None


def tune_glibc_malloc() -> bool:
    """Sets the thresholds above for this process; True when glibc accepted them."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                 TRIM_THRESHOLD_BYTES))
    logger.debug("glibc malloc thresholds %s", "set" if ok else "not accepted")
    return ok


def bound_onednn_caches(entries: int = ONEDNN_CACHE_ENTRIES) -> dict[str, str]:
    """Sets both oneDNN kernel caches' capacity (entries) for this process where the environment
    does not; returns the values in force. NOTE: read when the process runs its first oneDNN
    operation, so call it before any (an engine process does, before it loads the model); 0 would
    crash torch's cache."""
    assert entries >= 1, entries
    return {var: os.environ.setdefault(var, str(entries)) for var in ONEDNN_CACHE_VARIABLES}


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Asks Linux to back the 2 MiB-aligned part of a CPU tensor's memory with transparent huge
    pages; call before the memory is first written. True when the kernel accepted the advice."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return False
    start = t.data_ptr()
    lo = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    hi = (start + t.numel() * t.element_size()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if hi <= lo:
        return False
    madvise = _libc_function("madvise")
    if madvise is None:
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0


def trim_heap() -> bool:
    """glibc's malloc_trim(0): the heap's free pages go back to the OS (True if some did); ctypes
    drops the GIL during the call. False (and nothing done) elsewhere than glibc."""
    trim = _libc_function("malloc_trim")
    return bool(trim(0)) if trim is not None else False
