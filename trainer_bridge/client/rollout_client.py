"""``RolloutClient``: the trainer's async HTTP client for one or many ``rollout-serve`` servers.

See ``trainer_bridge.client`` for its behaviour. This module is the facade: construction,
lifecycle, balancing and the generation loop (each request retried until it resolves once). The
parts live next to it: ``transport`` (one ``/generate`` try), ``stream`` (SSE), ``response`` (a
response read into a ``Sample``), ``health`` (which servers are alive), ``control`` (control
endpoints), ``errors``, ``server_state``, ``request`` and ``model_info``.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import httpx

from capture.codec import RoutedExpertsFormat

from ..sample import Sample
from .control import _Control
from .errors import NoServerError, RolloutError, _Aborted, _ServerFailed
from .health import _Health
from .model_info import ModelInfo
from .request import Request
from .response import to_sample
from .router import _Router
from .server_state import ServerState, pick_server
from .transport import _Transport

ROUTING_FORMATS = tuple(f.value for f in RoutedExpertsFormat)   # the codec's one list


class RolloutClient(_Health, _Control, _Transport, _Router):
    """Async client over ``rollout-serve`` URLs; see ``trainer_bridge.client``.

    Args:
        urls: one URL or a list of them (None with ``router_url``).
        router_url: sglang-router in front of the servers: generations go through it, control
            calls and weight pushes to every worker it lists (``trainer_bridge.client.router``).
        api_key / admin_api_key: bearer keys (``admin_api_key`` is used for control and weight
            endpoints, and for everything when ``api_key`` is None).
        routing_format: ``"compact"`` (default, 1 byte per id here) or ``"int32"`` (SGLang's).
        stream: use SSE streaming for ``/generate``.
        timeout: seconds a request may take on one server before it is retried elsewhere.
        max_attempts: failed attempts per request over all servers (default: 2 per server, at
            least 3); aborts by a server pause are not failures.
        max_concurrency: requests in flight from this client at once.
        validate: validate samples on arrival (needs routing).
        return_routed_experts: ask for routing (the trainer's replay needs it).
        transport: an httpx transport (tests use ``httpx.MockTransport``).
        model_config: the model's ``config.json`` (or its directory), read for the routing shape
            when a server's ``/model_info`` does not report it (real SGLang).
    """

    def __init__(self, urls: Union[str, Sequence[str], None] = None, *, router_url: Optional[str] = None,
                 api_key: Optional[str] = None,
                 admin_api_key: Optional[str] = None, routing_format: str = "compact", stream: bool = False,
                 timeout: float = 600.0, connect_timeout: float = 10.0, max_attempts: Optional[int] = None,
                 max_concurrency: int = 512, validate: bool = True, return_routed_experts: bool = True,
                 retry_backoff_s: float = 0.05, health_timeout: float = 5.0,
                 transport: Optional[httpx.AsyncBaseTransport] = None, model_config: Optional[str] = None):
        urls = [urls] if isinstance(urls, str) else list(urls or [])
        if router_url is not None and urls:
            raise ValueError("give urls or router_url, not both (behind a router the workers are the router's)")
        if not urls and router_url is None:
            raise ValueError("RolloutClient needs at least one server URL (or router_url)")
        if len(set(urls)) != len(urls):
            raise ValueError(f"server URLs repeat: {urls}")
        if routing_format not in ROUTING_FORMATS:
            raise ValueError(f"routing_format must be one of {ROUTING_FORMATS}, got {routing_format!r}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.servers = [ServerState(u.rstrip("/"), i) for i, u in enumerate(urls)]
        self.router = ServerState(router_url.rstrip("/"), -1) if router_url is not None else None
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.routing_format = routing_format
        self.stream = stream
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_attempts = max_attempts or max(3, 2 * len(urls))   # behind a router: 3
        self.max_resubmits = 1000  # aborts by the servers (pause cycles) a request may go through
        self.max_concurrency = max_concurrency
        self.validate = validate
        self.return_routed_experts = return_routed_experts
        self.retry_backoff_s = retry_backoff_s
        self._transport = transport
        self.health_timeout = health_timeout
        self.model_config = model_config
        self.info: Optional[ModelInfo] = None
        self._http: Optional[httpx.AsyncClient] = None
        self._sem: Optional[asyncio.Semaphore] = None
        self._not_paused: Optional[asyncio.Event] = None
        self._rr = 0
        self._inflight: dict[str, ServerState] = {}  # rid -> server now running it
        self._aborted: set[str] = set()
        self._pending: set[str] = set()  # rids of every unresolved request of this client
        self.resubmitted = 0  # requests sent again after an abort this client did not ask for
        self.stale_retries = 0  # requests sent again after failing before any response byte

    # ---- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> "RolloutClient":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> "RolloutClient":
        if self._http is None:
            # NOTE: keep-alive expiry below the server's (--timeout-keep-alive, 75 s by default) so
            # that an idle pooled connection is dropped here before the server closes it.
            limits = httpx.Limits(max_connections=self.max_concurrency + 16,
                                  max_keepalive_connections=self.max_concurrency + 16, keepalive_expiry=2.0)
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout),
                                           limits=limits, transport=self._transport)
            self._sem = asyncio.Semaphore(self.max_concurrency)
            self._not_paused = asyncio.Event()
            self._not_paused.set()
        if self.router is not None and not self.servers:
            await self.refresh_workers()
            await self._check_router_routing()
        if self.info is None:
            self.info = await self.model_info()
        return self

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # ---- balancing -----------------------------------------------------------------------------
    def _pick(self, exclude: set[str]) -> ServerState:
        if self.router is not None:
            return pick_server([self.router], exclude, 0)
        best = pick_server(self.servers, exclude, self._rr)
        self._rr = (best.index + 1) % len(self.servers)
        return best

    def loads(self) -> dict[str, dict]:
        """This client's view per server: alive, outstanding, completed, failures, bytes."""
        out = {s.url: s.snapshot() for s in self.servers}
        if self.router is not None:
            out[self.router.url] = self.router.snapshot()
        return out

    # ---- generation --------------------------------------------------------------------------
    async def generate(self, input_ids: Sequence[int], sampling_params: Optional[Mapping] = None, *,
                       rid: Optional[str] = None, group_id: Any = None, meta: Optional[dict] = None) -> Sample:
        """One sample for ``input_ids``."""
        req = Request(input_ids=[int(t) for t in input_ids], sampling_params=dict(sampling_params or {}),
                      group_id=group_id, meta=dict(meta or {}))
        if rid is not None:
            req.rid = rid
        return (await self.generate_many([req]))[0]

    async def generate_groups(self, prompts: Sequence[Sequence[int]], n: int, sampling_params: Mapping, *,
                              group_ids: Optional[Sequence[Any]] = None, seed: int = 0, rid_prefix: str = "",
                              metas: Optional[Sequence[dict]] = None,
                              on_sample: Optional[Callable[[Sample], None]] = None) -> list[Sample]:
        """``n`` samples per prompt (a GRPO group each), prompt-major. Sample ``k`` of prompt ``i``
        has rid ``f"{rid_prefix}{i}-{k}"`` and a seed derived from ``(seed, i, k)``."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if group_ids is not None and len(group_ids) != len(prompts):
            raise ValueError(f"{len(group_ids)} group ids for {len(prompts)} prompts")
        prefix = rid_prefix or uuid.uuid4().hex[:12] + "-"
        reqs = []
        for i, p in enumerate(prompts):
            for k in range(n):
                sp = dict(sampling_params)
                sp["n"] = 1
                sp.setdefault("sampling_seed", (seed * 1_000_003 + i * 9_973 + k) % (2**62))
                meta = dict(metas[i]) if metas is not None else {}
                meta.update(prompt_index=i, sample_index=k)
                reqs.append(Request(input_ids=[int(t) for t in p], sampling_params=sp, rid=f"{prefix}{i}-{k}",
                                    group_id=group_ids[i] if group_ids is not None else i, meta=meta))
        return await self.generate_many(reqs, on_sample=on_sample)

    async def generate_many(self, requests: Sequence[Request],
                            on_sample: Optional[Callable[[Sample], None]] = None) -> list[Sample]:
        """Generate every request concurrently; samples in request order. ``on_sample`` is called
        as each one arrives (e.g. for progress)."""
        if self._http is None:
            await self.start()
        rids = [r.rid for r in requests]
        if len(set(rids)) != len(rids):
            raise ValueError("request rids must be unique")
        clash = [r for r in rids if r in self._pending]
        if clash:
            raise ValueError(f"rid {clash[0]!r} is already pending in this client")
        self._pending.update(rids)

        async def run(req: Request) -> Sample:
            s = await self._run(req)
            if on_sample is not None:
                on_sample(s)
            return s
        tasks = [asyncio.ensure_future(run(r)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            self._pending.difference_update(rids)

    async def _run(self, req: Request) -> Sample:
        req.fill_defaults()
        tried: set[str] = set()
        errors: list[str] = []
        attempts = failures = 0
        async with self._sem:
            while True:
                await self._not_paused.wait()
                server = self._pick(tried)
                attempts += 1
                t0 = time.perf_counter()
                server.outstanding += 1
                self._inflight[req.rid] = server
                try:
                    raw, nbytes = await (self._post_stream(server, req) if self.stream else self._post(server, req))
                    sample = to_sample(req, raw, server.url, info=self.info, aborted=self._aborted,
                                       return_routed_experts=self.return_routed_experts, validate=self.validate,
                                       attempts=attempts, latency=time.perf_counter() - t0, nbytes=nbytes)
                    if not server.holds(sample.weight_version):
                        # NOTE: its supervisor restarted it (on the same port) with its checkpoint's weights
                        raise _ServerFailed(f"answered with weight_version {sample.weight_version!r}, not the "
                                            f"{server.weight_version!r} this client pushed (restarted?)", dead=True)
                    server.completed += 1
                    return sample
                except _Aborted:
                    self.resubmitted += 1
                    errors.append(f"{server.url}: aborted by the server (pause or abort_all); submitted again")
                    if attempts >= self.max_resubmits:
                        raise RolloutError(f"request {req.rid!r} was aborted by the servers {attempts} times: "
                                           + " | ".join(errors[-4:])) from None
                except _ServerFailed as exc:
                    failures += 1
                    server.failures += 1
                    server.retried_away += 1
                    server.last_error = str(exc)
                    errors.append(f"{server.url}: {exc}")
                    tried.add(server.url)
                    if exc.dead:
                        server.alive = False
                finally:
                    server.outstanding -= 1
                    self._inflight.pop(req.rid, None)
                if failures >= self.max_attempts:
                    raise NoServerError(f"request {req.rid!r} failed {failures} times: " + " | ".join(errors[-4:]))
                if not any(s.alive for s in self.servers):
                    raise NoServerError(f"request {req.rid!r}: no live server left: " + " | ".join(errors[-4:]))
                await asyncio.sleep(self.retry_backoff_s)
