"""LoopFeeder: hands items from the engine client's receiver thread to one asyncio event loop.

The receiver thread delivers every update of an engine step at once (one StepOut: a chunk for each
of, say, 64 streams). Scheduling each item with its own `call_soon_threadsafe` wakes the loop (a
self-pipe write) and hands the GIL over once per item; the feeder batches them: the first item of
a batch schedules one drain, later ones only append.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any

from rollout.frontend.async_inbox import AsyncInbox


class LoopFeeder:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._batch: list[tuple[AsyncInbox, Any]] = []

    def inbox(self) -> AsyncInbox:
        """A new inbox on this loop whose sink() may be called from any thread."""
        inbox = AsyncInbox(self.loop)
        inbox.sink = lambda item: self.put(inbox, item)
        return inbox

    def put(self, inbox: AsyncInbox, item: Any) -> None:
        with self._lock:
            self._batch.append((inbox, item))
            wake = len(self._batch) == 1
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody is listening
                pass

    def _drain(self) -> None:
        with self._lock:
            batch, self._batch = self._batch, []
        for inbox, item in batch:
            inbox.put(item)
