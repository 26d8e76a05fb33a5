"""EngineStream: one submitted generation consumed from the event loop, aborted when its client goes away."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request

from rollout.generate_io import RolloutOutput, StreamChunk

KEEPALIVE_S = 5.0


class EngineStream:
    """Submits to the engine; yields StreamChunks (stream) or RolloutOutputs. close() aborts the rest."""

    def __init__(self, engine: Any, **kwargs: Any):
        self._inbox = engine.async_inbox()
        self.engine = engine
        self.submission = engine.submit(self._inbox.sink, **kwargs)
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

    async def outputs(self, request: Optional[Request] = None) -> list[RolloutOutput]:
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


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
