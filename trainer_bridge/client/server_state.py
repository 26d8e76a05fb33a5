"""``ServerState``: this client's view of one server (alive, load, counters), and the balancing
rule that picks a server for the next request."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .errors import NoServerError


@dataclass(eq=False)
class ServerState:
    url: str
    index: int
    alive: bool = True
    outstanding: int = 0
    completed: int = 0
    failures: int = 0
    retried_away: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    last_error: str = ""
    weight_version: str | None = None   # the weights this client last pushed to it (None: none pushed)
    pending_version: str | None = None  # the version a weight sync to it is pushing now

    def holds(self, version) -> bool:
        """Can a sample of weight_version ``version`` come from the server this client pushed to?
        (Always when it pushed nothing; while a push runs, the old version or the new one.)"""
        return self.weight_version is None or str(version) in (self.weight_version, self.pending_version)

    def snapshot(self) -> dict:
        return {"alive": self.alive, "outstanding": self.outstanding, "completed": self.completed,
                "failures": self.failures, "retried_away": self.retried_away, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "last_error": self.last_error}


def pick_server(servers: Sequence[ServerState], exclude: set[str], rr: int) -> ServerState:
    """The live server with the fewest requests outstanding, preferring those not in ``exclude``
    (URLs already tried); ties go round robin from index ``rr``."""
    live = [s for s in servers if s.alive]
    if not live:
        raise NoServerError("no live rollout server: " +
                            "; ".join(f"{s.url}: {s.last_error or 'dead'}" for s in servers))
    fresh = [s for s in live if s.url not in exclude] or live
    n = len(servers)
    return min(fresh, key=lambda s: (s.outstanding, (s.index - rr) % n))
