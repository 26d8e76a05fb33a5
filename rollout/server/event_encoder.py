"""EventEncoder: how a stream's chunks become server-sent events without stalling the event loop.

A cumulative `/generate` stream with top-20 logprobs resends everything so far in every chunk (n = 8,
800 tokens: ~0.5 MB per chunk at the end, 1.6 GB in all), and the engine delivers a step's chunks
at once: encoded on the loop, back to back, they held it for seconds (the generator does not
suspend while chunks are waiting and the socket takes the writes). So:

- a chunk past STREAM_OFF_LOOP_ENTRIES (token, logprob and top-logprob entries and routing rows) is
  built and encoded on a worker thread (the default executor: the pool the large non-streaming
  answers use), and its event is written in SEND_PIECE_BYTES pieces, so between pieces the
  transport's flow control lets the loop serve others;
- a small chunk (the usual case: text, a few logprobs) is built on the loop, as before; only when
  the stream has kept the loop for YIELD_AFTER_S without suspending does it yield once.

The events keep their order (each is awaited before the next is built) and their exact bytes
(the same `sse` encoding either way).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional

from rollout.server.http_io import SEND_PIECE_BYTES, sse

STREAM_OFF_LOOP_ENTRIES = 4000   # ~100 KB of JSON, ~0.5 ms to encode on the loop
YIELD_AFTER_S = 0.005


def chunk_entries(tokens: int, top_rows: Optional[list], logprobs: bool, routing_rows: int = 0) -> int:
    """About how many JSON entries an event holds: `tokens` output tokens (all so far in a cumulative
    chunk), each with its logprob and its top-logprob row when asked, and the routing rows it carries."""
    width = 1 + int(logprobs) + (len(top_rows[0]) if top_rows else 0)
    return tokens * width + routing_rows


class EventEncoder:
    """One stream's events: `for piece in await encoder.pieces(build, entries): yield piece`."""

    def __init__(self) -> None:
        self._busy_since = time.perf_counter()

    async def pieces(self, build: Callable[[], Any], entries: int) -> list[bytes]:
        """The SSE event of `build()`, in the pieces to write (one piece unless it is large)."""
        if entries <= STREAM_OFF_LOOP_ENTRIES:
            event = sse(build())
            if time.perf_counter() - self._busy_since > YIELD_AFTER_S:
                await asyncio.sleep(0)
                self._busy_since = time.perf_counter()
            return [event]
        event = await asyncio.to_thread(lambda: sse(build()))
        self._busy_since = time.perf_counter()
        if len(event) <= SEND_PIECE_BYTES:
            return [event]
        return [event[i:i + SEND_PIECE_BYTES] for i in range(0, len(event), SEND_PIECE_BYTES)]
