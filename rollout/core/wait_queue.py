"""WaitQueue: the scheduler's queue of waiting requests, with O(1) removal of any member.

Order is FIFO for added requests; a retracted request goes to the very front (the last one
pushed to the front comes first). Built from two insertion-ordered dicts, so append, push to the
front, remove and membership are O(1) and abort of n queued requests costs O(n), not O(n^2).
"""
from __future__ import annotations

from itertools import chain
from typing import Iterator

from rollout.core.request import Req


class WaitQueue:
    def __init__(self) -> None:
        self._front: dict[Req, None] = {}   # pushed to the front; iterated newest first
        self._back: dict[Req, None] = {}    # appended; iterated oldest first

    def append(self, req: Req) -> None:
        assert req not in self, f"request {req.rid} queued twice"
        self._back[req] = None

    def appendleft(self, req: Req) -> None:
        assert req not in self, f"request {req.rid} queued twice"
        self._front[req] = None

    def remove(self, req: Req) -> None:
        """Takes a queued request out (KeyError if it is not queued)."""
        if req in self._front:
            del self._front[req]
        else:
            del self._back[req]

    def discard_all(self) -> list[Req]:
        """Empties the queue; returns its members in queue order."""
        out = list(self)
        self._front.clear()
        self._back.clear()
        return out

    def __contains__(self, req: object) -> bool:
        return req in self._back or req in self._front

    def __len__(self) -> int:
        return len(self._front) + len(self._back)

    def __bool__(self) -> bool:
        return bool(self._back) or bool(self._front)

    def __iter__(self) -> Iterator[Req]:
        """Queue order. NOTE: do not add or remove while iterating (dicts refuse it)."""
        return chain(reversed(self._front), self._back)
