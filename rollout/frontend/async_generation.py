"""A generation consumed on an asyncio event loop.

AsyncGeneration: what Rollout.async_generate returns (await it, or iterate it). EngineStream: one
submitted generation as the server consumes it, aborted when its client goes away.

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
from typing import Any, AsyncIterator, Callable, Optional, Union

from rollout.generate_io import GenerateArgs, RolloutOutput, StreamChunk, Submission

KEEPALIVE_S = 5.0


class AsyncGeneration:
    """`await` it for the list of outputs, or `async for` over it for chunks (stream) / outputs."""

    def __init__(self, start: Callable[[Callable[[Any], None]], Submission], make_inbox: Callable[[], AsyncInbox],
                 stream: bool):
        self._start = start
        self._make_inbox = make_inbox
        self._stream = stream

    def __await__(self):
        return self._collect().__await__()

    async def _collect(self) -> list[RolloutOutput]:
        finals: dict[str, RolloutOutput] = {}
        order: list[str] = []
        async for item in self._iterate(final_only=True, order_out=order):
            finals[item.rid] = item
        return [finals[rid] for rid in order]

    def __aiter__(self) -> AsyncIterator[Union[StreamChunk, RolloutOutput]]:
        return self._iterate(final_only=not self._stream, order_out=[])

    async def _iterate(self, final_only: bool, order_out: list[str]):
        inbox = self._make_inbox()
        rids = self._start(inbox.sink).rids
        order_out.extend(rids)
        pending = set(rids)
        while pending:
            item = await inbox.get()
            if isinstance(item, BaseException):
                raise item
            done = isinstance(item, RolloutOutput) or item.finished
            if done:
                pending.discard(item.rid)
            if isinstance(item, StreamChunk) and final_only:
                if item.finished:
                    yield item.output
                continue
            yield item


class EngineStream:
    """Submits to the engine; yields StreamChunks (stream) or RolloutOutputs. close() aborts the rest."""

    def __init__(self, engine: Any, args: GenerateArgs):
        self._inbox = engine.async_inbox()
        self.engine = engine
        self.submission = engine.submit(self._inbox.sink, args)
        self._pending = set(self.rids)

    @property
    def rids(self) -> list[str]:
        """Request ids in output order (prompt-major)."""
        return self.submission.rids

    @property
    def done(self) -> bool:
        return not self._pending

    async def next(self, timeout: Optional[float] = None) -> Any:
        """The next item; None on timeout. Engine errors are raised."""
        item = await self._inbox.get(timeout)
        if item is None:
            return None
        if isinstance(item, BaseException):
            self._pending.clear()
            raise item
        if isinstance(item, RolloutOutput) or (isinstance(item, StreamChunk) and item.finished):
            self._pending.discard(item.rid)
        return item

    async def items(self, keepalive: bool = False) -> AsyncIterator[Any]:
        """Every item; with keepalive, None after KEEPALIVE_S of silence (the caller sends a comment)."""
        while self._pending:
            item = await self.next(KEEPALIVE_S if keepalive else None)
            if item is not None or keepalive:
                yield item

    async def outputs(self, request: Any = None) -> list[RolloutOutput]:
        """Final outputs in rid order; aborts and raises ClientGone if the client disconnects first."""
        finals: dict[str, RolloutOutput] = {}

        async def run() -> None:
            async for item in self.items():
                if isinstance(item, RolloutOutput):
                    finals[item.rid] = item

        task = asyncio.ensure_future(run())
        watch = asyncio.ensure_future(wait_disconnect(request)) if request is not None else None
        try:
            done, _ = await asyncio.wait({task} | ({watch} if watch else set()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                raise ClientGone()
            task.result()
            return [finals[r] for r in self.rids]
        finally:
            for t in (task, watch):
                if t is not None and not t.done():
                    t.cancel()
            self.close()

    def close(self) -> None:
        if self._pending:
            self.engine.abort_nowait(sorted(self._pending))
            self._pending.clear()


class ClientGone(Exception):
    """The HTTP client disconnected before its result was ready (its requests were aborted)."""


async def wait_disconnect(request: Any) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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


class LoopFeeders:
    """One LoopFeeder per event loop, made on first use (closed loops' feeders are dropped then)."""

    def __init__(self) -> None:
        self._feeders: dict[Any, LoopFeeder] = {}
        self._lock = threading.Lock()

    def inbox(self) -> AsyncInbox:
        """An inbox on the running event loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            feeder = self._feeders.get(loop)
            if feeder is None:
                for old in [lp for lp in self._feeders if lp.is_closed()]:
                    del self._feeders[old]
                feeder = self._feeders[loop] = LoopFeeder(loop)
        return feeder.inbox()
