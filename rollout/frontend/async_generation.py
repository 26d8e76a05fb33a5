"""AsyncGeneration: what Rollout.async_generate returns (await it, or iterate it)."""
from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Union

from rollout.frontend.async_inbox import AsyncInbox
from rollout.generate_io import RolloutOutput, StreamChunk, Submission


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
