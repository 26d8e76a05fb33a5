"""EngineClient: how the front end drives an engine (a process, DP ranks, or a thread for tests)."""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, Protocol

from rollout.ipc.messages import Reply, ReqSpec, ReqUpdate


class EngineDeadError(RuntimeError):
    """The engine stopped (crashed, was killed, or shut down); every pending request receives this."""


class WeightsInconsistentError(RuntimeError):
    """A weight update failed after part of the weights were copied: no request runs until an
    update rewrites them (rollout-serve answers 503)."""


class RidInFlightError(ValueError):
    """A request with this rid is still in flight (HTTP 400, error type "rid_in_flight_error")."""


UpdatesCallback = Callable[[list[ReqUpdate]], None]
DeadCallback = Callable[[str], None]


class EngineClient(Protocol):
    dp_size: int
    kv_capacity: int            # KV slots per rank: a request's prompt + max_new_tokens must fit
    context_length: int

    def add(self, groups: list[list[ReqSpec]]) -> None:
        """Queues one call's requests, each prompt's group (its n samples) on one rank, in one
        message per rank (so the engine schedules them together)."""

    def abort(self, uids: list[int], message: str = "aborted by request") -> None:
        """Aborts without waiting; unknown or finished uids are ignored."""

    def call(self, method: str, *args: Any) -> list[Any]:
        """Runs an engine command (an EngineCore method: rollout/core/engine_proc.py, CALLS) on every rank between
        steps; the per-rank results. A ValueError raised there is raised here."""

    @property
    def dead_reason(self) -> Optional[str]:
        """Why the engine is dead, or None while it lives."""

    @property
    def steps_done(self) -> int:
        """Steps the engine finished (reported after every step)."""

    def pids(self) -> list[int]:
        """The engine processes' pids (empty for an in-process engine)."""

    def close(self) -> None:
        """Stops the engine; idempotent."""


def raise_reply(error: Optional[str], error_type: Optional[str]) -> None:
    """Re-raises an engine command's error in the caller (ValueError stays ValueError)."""
    if error is None:
        return
    if error_type == "ValueError":
        raise ValueError(error)
    if error_type == "EngineDeadError":
        raise EngineDeadError(error)
    raise RuntimeError(f"{error_type}: {error}")


class PendingCalls:
    """The engine commands waiting for their replies (one future per rank each), for every client."""

    def __init__(self, ranks: int):
        self._ranks = ranks
        self._lock = threading.Lock()
        self._calls: dict[int, list[Future]] = {}
        self._ids = itertools.count(1)

    def open(self) -> tuple[int, list[Future]]:
        call_id = next(self._ids)
        futures = [Future() for _ in range(self._ranks)]
        with self._lock:
            self._calls[call_id] = futures
        return call_id, futures

    def close(self, call_id: int) -> None:
        with self._lock:
            self._calls.pop(call_id, None)

    def resolve(self, reply: Reply, rank: int = 0) -> None:
        """A rank's reply: its result, or its error raised in the caller (raise_reply)."""
        with self._lock:
            futures = self._calls.get(reply.call_id)
        if futures is None or futures[rank].done():
            return
        try:
            raise_reply(reply.error, reply.error_type)
        except Exception as exc:  # noqa: BLE001
            futures[rank].set_exception(exc)
        else:
            futures[rank].set_result(reply.result)

    def fail_all(self, reason: str) -> None:
        """Every waiting call raises EngineDeadError(reason)."""
        with self._lock:
            calls = list(self._calls.values())
        for futures in calls:
            for fut in futures:
                if not fut.done():
                    fut.set_exception(EngineDeadError(reason))

    @staticmethod
    def wait(futures: list[Future], check: Callable[[], None]) -> list[Any]:
        """The futures' results in order; check() (raises once the engine is dead) every 0.5 s."""
        out = []
        for fut in futures:
            while True:
                try:
                    out.append(fut.result(timeout=0.5))
                    break
                except TimeoutError:
                    check()
        return out
