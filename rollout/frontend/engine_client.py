"""EngineClient: how the front end drives an engine (a process, DP ranks, or a thread for tests)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from rollout.ipc.messages import ReqSpec, ReqUpdate


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
