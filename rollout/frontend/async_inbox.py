"""AsyncInbox and LoopFeeder: the hand-off of a generation's items (chunks, outputs, errors) from the
engine client's receiver thread to an asyncio event loop.

AsyncInbox is lighter than asyncio.Queue + asyncio.wait_for for a keep-alive timeout: a wait is one
future and one timer handle, not a task per item.

The receiver thread delivers every update of an engine step at once (one StepOut: a chunk for each
of, say, 64 streams). Scheduling each item with its own `call_soon_threadsafe` wakes the loop (a
self-pipe write) and hands the GIL over once per item; the LoopFeeder batches them: the first item
of a batch schedules one drain, later ones only append.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any, Callable, Optional

class AsyncInbox:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: deque = deque()
        self._waiter: Optional[asyncio.Future] = None
        self.sink: Callable[[Any], None] = self.put   # LoopFeeder.inbox() points it at the feeder

    def put(self, item: Any) -> None:
        """On the loop's thread."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self, timeout: Optional[float] = None) -> Any:
        """The next item; None when `timeout` seconds pass without one."""
        if not self._items:
            self._waiter = waiter = self._loop.create_future()
            timer = self._loop.call_later(timeout, _wake, waiter) if timeout else None
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if not self._items:
                return None
        return self._items.popleft()


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


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
