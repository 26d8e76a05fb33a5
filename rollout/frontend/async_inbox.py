"""AsyncInbox: one generation's items (chunks, outputs, errors), awaited on an event loop.

Lighter than asyncio.Queue + asyncio.wait_for for a keep-alive timeout: a wait is one future and
one timer handle, not a task per item.
"""
from __future__ import annotations

import asyncio
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
