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

Large buffers that must start zero (the KV pool) are zeroed without being written: their pages go
back to the kernel (`MADV_DONTNEED`), after which private anonymous memory reads as zero and is
faulted in only where it is first touched. On the project's VMs, writing zeros over the default
512 MiB pool, on transparent huge pages as the pool then asked for, took 3 s of every CPU engine's
startup (fresh huge pages fault in slowly there) and made the whole pool resident where a run used
a few MiB of it. Huge pages are no longer asked for: on the throughput workload the pool ran as fast
without them (2026-12-05: 0.99-1.01x), and faulted in lazily they ran at 0.92-0.97x.
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
_MADV_DONTNEED = 4                     # Linux
_PROC_MAPS = "/proc/self/maps"
ONEDNN_CACHE_ENTRIES = 256
ONEDNN_CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


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


def _private_anonymous(lo: int, hi: int) -> bool:
    """Whether the bytes lo .. hi-1 lie in private anonymous mappings of this process (the heap or
    anonymous mmaps, which madvise may have split: their dropped pages read back as zero); False
    where it cannot tell."""
    covered = lo
    try:
        with open(_PROC_MAPS) as f:
            for line in f:
                fields = line.split()
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if end <= covered or start >= hi:
                    continue
                path = fields[5] if len(fields) > 5 else ""
                if start > covered or fields[1][3] != "p" or fields[4] != "0" or path not in ("", "[heap]"):
                    return False
                covered = end
                if covered >= hi:
                    return True
    except (OSError, ValueError, IndexError):
        pass
    return False


def zero_lazily(t: torch.Tensor) -> torch.Tensor:
    """Zeroes a tensor in place and returns it. For a contiguous CPU tensor in private anonymous
    memory (what torch's CPU allocator hands out) the whole pages inside it are given back to the
    kernel, to be faulted in zero-filled on first touch, and only the bytes around them are written:
    no time and no resident memory until the buffer is used. Elsewhere (another device, a shared
    or file mapping, no madvise) zero_()."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return t.zero_()
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // page) * page, end // page * page
    madvise = _libc_function("madvise")
    if hi - lo < page or madvise is None or not _private_anonymous(lo, hi):
        return t.zero_()
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if madvise(lo, hi - lo, _MADV_DONTNEED) != 0:
        return t.zero_()
    flat = t.view(-1).view(torch.uint8)
    flat[:lo - start].zero_()
    flat[hi - start:].zero_()
    return t


def trim_heap() -> bool:
    """glibc's malloc_trim(0): the heap's free pages go back to the OS (True if some did); ctypes
    drops the GIL during the call. False (and nothing done) elsewhere than glibc."""
    trim = _libc_function("malloc_trim")
    return bool(trim(0)) if trim is not None else False
