"""trim_heap: glibc's malloc_trim(0) after a large request, so that the heap pages its copies (a 30 MB
body, its parsed strings, a 57 MB answer) used go back to the OS instead of staying in RSS (measured
with scripts/bench_hostile.py: +34 MB after a refused 30 MB text and +53 MB after a 30 MB chat
message without it, +17 MB and +0 with it). Elsewhere than glibc it does nothing."""
from __future__ import annotations

from rollout.host_malloc import trim_heap

TRIM_AFTER_BYTES = 1 << 20   # a request whose body or answer is larger is followed by a trim

__all__ = ["TRIM_AFTER_BYTES", "trim_heap"]
