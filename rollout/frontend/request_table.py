"""RequestTable: the front end's requests in flight, by uid and by rid.

Each sample of a call is one RequestState with its own integer uid (the engine's key). A rid
finds every uid it names: a sample's rid (rid_k for the samples of an n > 1 request), and the
caller's rid of an n > 1 request (its group_rid), which names all of its samples. The table is
shared by the caller's threads and the engine client's receiver thread: every access holds its lock.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from rollout.frontend.engine_client import RidInFlightError
from rollout.frontend.request_state import RequestState
from rollout.ipc.messages import ReqUpdate

Deliveries = list[tuple[Callable[[Any], None], list[Any]]]


class RequestTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[int, RequestState] = {}
        self._rids: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._states)

    def add(self, states: Sequence[RequestState], sink: Callable[[Any], None]) -> None:
        """Registers one call's requests, all answering to sink; none if any rid is in flight."""
        with self._lock:
            clash = [st.rid for st in states if st.rid in self._rids or st.group_rid in self._rids]
            if clash:
                raise RidInFlightError(f"rid {clash[0]!r} is already in flight; rids must be unique")
            for st in states:
                st.sink = sink
                self._states[st.uid] = st
                for key in {st.rid, st.group_rid}:
                    self._rids.setdefault(key, []).append(st.uid)

    def discard(self, states: Sequence[RequestState]) -> None:
        """Forgets requests the engine never received."""
        with self._lock:
            for st in states:
                if st.uid in self._states:
                    self._forget(st)

    def apply(self, updates: list[ReqUpdate]) -> tuple[Deliveries, list[int]]:
        """Applies the engine's updates: (sink, items) to deliver, and the uids that hit a stop
        string (the engine must abort them). Finished requests leave the table."""
        deliveries: Deliveries = []
        stopped: list[int] = []
        with self._lock:
            for upd in updates:
                st = self._states.get(upd.uid)
                if st is None:
                    continue  # NOTE: finished here already (a stop string hit); the engine's abort follows
                items, stop_hit = st.apply(upd)
                if stop_hit:
                    stopped.append(upd.uid)
                if st.done:
                    self._forget(st)
                if items:
                    deliveries.append((st.sink, items))
        return deliveries, stopped

    def uids(self) -> list[int]:
        with self._lock:
            return list(self._states)

    def uids_of(self, rids: Sequence[str]) -> list[int]:
        with self._lock:
            return [uid for r in rids for uid in self._rids.get(r, ())]

    def clear(self) -> list[RequestState]:
        """Empties the table (the engine died); the requests that were in it."""
        with self._lock:
            states = list(self._states.values())
            self._states.clear()
            self._rids.clear()
        return states

    def _forget(self, st: RequestState) -> None:
        del self._states[st.uid]
        for key in {st.rid, st.group_rid}:
            uids = self._rids.get(key)
            if uids is not None:
                uids.remove(st.uid)
                if not uids:
                    del self._rids[key]
