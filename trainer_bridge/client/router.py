"""``_Router``: a ``RolloutClient`` in front of sglang-router (``router_url=``).

Generations go through the router (it picks the worker). The router rebuilds ``/generate``
bodies from its own schema and drops ``return_routed_experts``, so the workers run with
``--default-return-routed-experts`` (checked at start). Control calls the router does not
forward (pause, continue, abort by rid, weight pushes) go to every worker the router lists
(``GET /workers``), read again before each such call, so workers added to or removed from the
router are followed.
"""
from __future__ import annotations

from typing import Optional

import httpx

from .errors import NoServerError, RolloutError
from .server_state import ServerState


class _Router:
    """Needs the client's ``servers``, ``_http``, ``_headers`` and ``return_routed_experts``."""

    router: Optional[ServerState]
    servers: list[ServerState]
    _http: Optional[httpx.AsyncClient]
    return_routed_experts: bool

    async def router_workers(self) -> list[str]:
        """The URLs of the healthy workers the router lists."""
        try:
            r = await self._http.get(self.router.url + "/workers", headers=self._headers(admin=True), timeout=30)
            r.raise_for_status()
            listed = r.json().get("workers", [])
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise NoServerError(f"{self.router.url}/workers failed: {type(exc).__name__}: {exc}") from None
        return [w["url"].rstrip("/") for w in listed if isinstance(w, dict) and isinstance(w.get("url"), str)
                and w.get("is_healthy", True)]

    async def refresh_workers(self) -> list[str]:
        """Takes the router's worker list as this client's servers (keeping each known one's
        counters); returns their URLs. A no-op without a router."""
        if self.router is None:
            return [s.url for s in self.servers]
        urls = await self.router_workers()
        if not urls:
            raise NoServerError(f"the router {self.router.url} lists no healthy worker")
        known = {s.url: s for s in self.servers}
        self.servers = [known.get(u) or ServerState(u, i) for i, u in enumerate(urls)]
        for i, s in enumerate(self.servers):
            s.index, s.alive = i, True
        return urls

    async def _check_router_routing(self) -> None:
        """Routing behind the router needs workers that return it by default."""
        if not self.return_routed_experts:
            return
        for s in self.servers:
            r = await self._http.get(s.url + "/server_info", headers=self._headers(), timeout=30)
            if r.status_code == 200 and not r.json().get("default_return_routed_experts"):
                raise RolloutError(f"{s.url} behind the router {self.router.url} does not return routed experts "
                                   f"by default: sglang-router drops return_routed_experts, so start the workers "
                                   f"with --enable-return-routed-experts --default-return-routed-experts")
