"""``_Health``: which servers a ``RolloutClient`` sends to. Health checks, marking a server dead,
finding dead ones that answer again, and reviving them (after they got the current weights)."""
from __future__ import annotations

import asyncio
from typing import Optional

import httpx

from .server_state import ServerState


class _Health:
    """Needs the client's ``servers``, ``_http`` and ``health_timeout``."""

    servers: list[ServerState]
    _http: Optional[httpx.AsyncClient]
    health_timeout: float

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def alive_urls(self) -> list[str]:
        return [s.url for s in self.servers if s.alive]

    async def check_servers(self) -> list[str]:
        """Health-checks every live server now, marks the ones that do not answer dead, and
        returns the live URLs (e.g. after a weight sync failed: did a server die meanwhile?)."""
        live = [s for s in self.servers if s.alive]
        answers = await asyncio.gather(*(self._healthy(s) for s in live))
        for s, ok in zip(live, answers):
            if not ok:
                s.alive, s.last_error = False, "no answer to /health"
        return self.alive_urls

    async def recovered(self) -> list[str]:
        """Dead servers that answer /health again (e.g. restarted by their supervisor). They stay
        dead to this client until `revive` (after they got the current weights)."""
        dead = [s for s in self.servers if not s.alive]
        answers = await asyncio.gather(*(self._healthy(s) for s in dead))
        return [s.url for s, ok in zip(dead, answers) if ok]

    def _server(self, url: str) -> ServerState:
        for s in self.servers:
            if s.url == url.rstrip("/"):
                return s
        raise ValueError(f"unknown server {url!r}; this client has {self.urls}")

    def mark_dead(self, url: str, reason: str = "marked dead") -> None:
        s = self._server(url)
        s.alive, s.last_error = False, reason

    def revive(self, url: str) -> None:
        """Let a server take requests again (after it restarted and got the current weights)."""
        self._server(url).alive = True

    def pushing(self, url: str, version: str | None) -> None:
        """A weight sync of ``version`` to the server starts (None: it ended)."""
        self._server(url).pending_version = version

    def pushed(self, url: str, version: str) -> None:
        """The server now holds the weights of ``version`` (a weight sync to it succeeded)."""
        s = self._server(url)
        s.weight_version, s.pending_version = version, None

    async def _still_serving(self, server: ServerState) -> bool:
        """After a transport error: is the same server still up? It answers /health, and holds the
        weights this client last pushed to it. (One its supervisor restarted answers /health with
        its checkpoint's weights: dead to this client until a weight sync brings it back.)"""
        if not await self._healthy(server):
            return False
        if server.weight_version is None:
            return True
        try:
            r = await self._http.get(server.url + "/get_weight_version", timeout=self.health_timeout)
            return r.status_code == 200 and server.holds(r.json().get("weight_version"))
        except (httpx.HTTPError, ValueError, AttributeError):
            return False

    async def _healthy(self, server: ServerState) -> bool:
        """After a transport error: is the server still up? (A pooled keep-alive connection the
        server closed at the same moment gives the same errors as a dead server.)"""
        try:
            r = await self._http.get(server.url + "/health", timeout=self.health_timeout)
            return r.status_code == 200
        except httpx.HTTPError:
            return False
