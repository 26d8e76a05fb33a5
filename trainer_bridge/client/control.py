"""``_Control``: a ``RolloutClient``'s calls to every live server's info and control endpoints:
``/model_info``, ``/v1/loads``, weight versions, pause / continue, and aborting this client's
requests in flight."""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional, Sequence

import httpx

from .errors import NoServerError, RolloutError
from .model_info import ModelInfo
from .server_state import ServerState


class _Control:
    """Needs the client's ``servers``, ``_http``, ``_headers``, ``model_config``, the pause event
    and the rid -> server map of requests in flight."""

    servers: list[ServerState]
    alive_urls: list[str]   # from _Health
    _http: Optional[httpx.AsyncClient]
    _headers: Callable[..., dict]   # from _Transport
    model_config: Optional[str]
    _not_paused: Optional[asyncio.Event]
    _inflight: dict[str, ServerState]
    _aborted: set[str]
    refresh_workers: Callable[[], Any]   # from _Router

    async def server_loads(self) -> dict[str, Any]:
        """Each live server's ``/v1/loads`` (an ``{"error": ...}`` entry where it did not answer)."""
        async def one(s: ServerState):
            try:
                r = await self._http.get(s.url + "/v1/loads", headers=self._headers(), timeout=10)
                r.raise_for_status()
                return r.json()
            except (httpx.HTTPError, ValueError) as exc:
                return {"error": f"{type(exc).__name__}: {exc}"}
        res = await asyncio.gather(*(one(s) for s in self.servers if s.alive))
        return dict(zip(self.alive_urls, res))

    async def model_info(self) -> ModelInfo:
        """``/model_info`` of every live server; they must serve the same model."""
        infos = {}
        for s in self.servers:
            if not s.alive:
                continue
            try:
                r = await self._http.get(s.url + "/model_info", headers=self._headers(), timeout=30)
                r.raise_for_status()
                infos[s.url] = ModelInfo.from_json(r.json(), self.model_config)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                s.alive, s.last_error = False, f"/model_info failed: {type(exc).__name__}: {exc}"
        if not infos:
            raise NoServerError("no rollout server answered /model_info: " +
                                "; ".join(f"{s.url}: {s.last_error}" for s in self.servers))
        first_url, first = next(iter(infos.items()))
        for url, info in infos.items():
            if not info.same_model(first):
                raise RolloutError(f"servers serve different models: {first_url} {first} vs {url} {info}")
        return first

    async def _post_all(self, path: str, body: Optional[dict] = None, *, timeout: float = 600.0) -> dict[str, Any]:
        await self.refresh_workers()   # behind a router: every worker it lists now
        async def one(s: ServerState):
            r = await self._http.post(s.url + path, json=body or {}, headers=self._headers(admin=True),
                                      timeout=timeout)
            if r.status_code >= 400:
                raise RolloutError(f"{s.url}{path}: HTTP {r.status_code}: {r.text[:300]}")
            return r.json()
        live = [s for s in self.servers if s.alive]
        return dict(zip([s.url for s in live], await asyncio.gather(*(one(s) for s in live))))

    async def weight_versions(self) -> dict[str, str]:
        out = {}
        for s in self.servers:
            if s.alive:
                r = await self._http.get(s.url + "/get_weight_version", headers=self._headers(), timeout=30)
                out[s.url] = r.json()["weight_version"]
        return out

    # ---- pause / abort -----------------------------------------------------------------------
    async def pause(self, mode: str = "retract") -> dict[str, Any]:
        """Stop sending new requests and pause every live server (``abort`` | ``retract`` | ``in_place``).

        With ``abort`` the servers return the running requests aborted; this client submits them
        again (same rid and seed) and they run after ``continue_generation``.
        """
        self._not_paused.clear()
        return await self._post_all("/pause_generation", {"mode": mode})

    async def flush_cache(self) -> dict[str, Any]:
        """``/flush_cache`` on every live server (400 while requests hold KV: raises RolloutError)."""
        return await self._post_all("/flush_cache")

    async def continue_generation(self) -> dict[str, Any]:
        res = await self._post_all("/continue_generation")
        self._not_paused.set()
        return res

    @property
    def paused(self) -> bool:
        return self._not_paused is not None and not self._not_paused.is_set()

    async def abort(self, rids: Optional[Sequence[str]] = None) -> int:
        """Abort this client's requests in flight (all by default); they resolve as partial samples."""
        targets = list(self._inflight) if rids is None else list(rids)
        self._aborted.update(targets)

        async def at(url: str, rid: str) -> int:
            try:
                r = await self._http.post(url + "/abort_request", json={"rid": rid}, headers=self._headers(),
                                          timeout=30)
                return int(r.json().get("num_aborted", 0)) if r.status_code == 200 else 0
            except (httpx.HTTPError, ValueError):
                return 0

        async def one(rid: str):
            s = self._inflight.get(rid)
            if s is None:
                return 0
            # NOTE: behind a router the worker running rid is unknown: every worker is asked
            urls = [w.url for w in self.servers if w.alive] if s is getattr(self, "router", None) else [s.url]
            return sum(await asyncio.gather(*(at(u, rid) for u in urls)))
        return sum(await asyncio.gather(*(one(r) for r in targets)))
