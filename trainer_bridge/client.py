"""``RolloutClient``: the trainer's async HTTP client for one or many ``rollout-serve`` servers.

Token ids in, ``Sample`` records out::

    async with RolloutClient(["http://127.0.0.1:30000", "http://127.0.0.1:30001"]) as client:
        samples = await client.generate_groups(prompt_ids, n=8,
                                               sampling_params={"temperature": 1.0, "max_new_tokens": 16})

Behaviour:
- Balance: each request goes to the live server with the fewest requests outstanding from this
  client (ties: round robin).
- Every request carries an explicit ``rid`` and ``sampling_seed``. A request that fails on a
  server (connection refused or reset, HTTP 5xx, timeout) is sent again, with the same ``rid`` and
  seed, to another server; a 503, or a transport error after which ``/health`` does not answer,
  marks the server dead (``revive`` brings it back). Each request resolves exactly once, so no
  sample is lost and none is duplicated.
- Pause/abort: a request that comes back ``finish_reason: abort`` without this client having
  aborted it (a ``/pause_generation`` in ``abort`` mode, an admin ``abort_all``) is submitted again
  (servers queue new requests while paused, so it runs after ``/continue_generation``). While this
  client is paused (``pause``) it sends nothing new. ``abort`` aborts this client's requests in
  flight: they resolve as partial samples (``meta["finish_reason"] == "abort"``), never retried
  (requests not yet sent are not affected: cancel the ``generate_*`` task to drop them).
- A request that fails before any response byte (a pooled connection the server closed just as
  the request was written: ``RemoteProtocolError``/``ReadError``/``WriteError``/``ConnectError``)
  is sent again at once on a fresh connection (same ``rid``), up to ``STALE_CONNECTION_RETRIES``
  times, without counting as a failed attempt.
- Streaming (``stream=True``): SSE chunks are assembled (tokens, logprobs and the routing rows that
  became final in each chunk); a stream cut off mid-way is retried like any failed request.
- Routing is decoded with ``capture.codec`` into ``[T - 1, num_layers, top_k]`` int32 tensors and
  each sample is validated on arrival (``Sample.validate``: shape against the token count, ids in
  ``[0, num_experts)``, k distinct ids per MoE row); a bad sample raises ``SampleError`` naming its
  ``rid`` and server.
- ``loads()``: this client's per-server counters; ``await server_loads()``: each server's
  ``/v1/loads``.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import httpx
import torch

from capture.codec import decode_routed_experts

from .sample import Sample

__all__ = ["RolloutClient", "ModelInfo", "RolloutError", "NoServerError", "SampleError", "RequestRejected"]

ROUTING_FORMATS = ("compact", "int32")
_COMPACT_B64 = "UkVYQ"  # base64 of the compact format's magic b"REXC" (never valid int32 expert ids)
_RETRY_STATUS = {500, 502, 503, 504}
_TRANSPORT_ERRORS = (httpx.TransportError,)  # connect/read/write errors, protocol errors, timeouts
# NOTE: a pooled keep-alive connection that the server closes just as a request is written to it
# fails with one of these before any response byte; the request is then sent again at once.
_STALE_CONNECTION_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError)
STALE_CONNECTION_RETRIES = 2
ABORT_BEFORE_PREFILL = "Abort before prefill"


RID_IN_FLIGHT = "rid_in_flight_error"   # the server's error type for a rid still in flight (docs/protocol.md)

class RolloutError(RuntimeError):
    """A request could not be completed."""


class NoServerError(RolloutError):
    """No live server is left (or every attempt failed)."""


class RequestRejected(ValueError):
    """A server answered 4xx: the request itself is wrong (never retried)."""


class SampleError(ValueError):
    """A response failed validation (names the rid and the server)."""


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    num_layers: int
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    vocab_size: int
    weight_version: str = ""
    architecture: str = ""

    @classmethod
    def from_json(cls, d: Mapping, config_path: Optional[str] = None) -> "ModelInfo":
        """From ``/model_info``. A server that does not report the routing shape (real SGLang) is
        read through the model's ``config.json``: ``config_path`` or, when that is None, the
        ``model_path`` the server reports (the trainer usually holds the same checkpoint)."""
        if "num_hidden_layers" not in d:
            return cls.from_config(config_path or str(d.get("model_path") or ""),
                                   weight_version=str(d.get("weight_version", "")))
        return cls(num_layers=int(d["num_hidden_layers"]), num_experts=int(d["num_experts"]),
                   top_k=int(d["num_experts_per_tok"]), moe_layers=tuple(d.get("moe_layer_ids") or ()),
                   vocab_size=int(d["vocab_size"]), weight_version=str(d.get("weight_version", "")),
                   architecture=str(d.get("architecture", "")))

    @classmethod
    def from_config(cls, path: str, weight_version: str = "") -> "ModelInfo":
        """The routing shape from a HF ``config.json`` (a file or its directory)."""
        import os  # noqa: PLC0415

        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        try:
            with open(file) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as exc:
            raise KeyError(f"the server reports no routing shape and {file!r} is not readable ({exc}); pass "
                           f"RolloutClient(model_config=...)") from None
        cfg = cfg.get("text_config", cfg)
        layers = int(cfg["num_hidden_layers"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"))
        only = set(cfg.get("mlp_only_layers") or ())
        step = int(cfg.get("decoder_sparse_step") or 1)
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        moe = tuple(i for i in range(layers) if i not in only and (i + 1) % step == 0 and i >= first_dense)
        arch = (cfg.get("architectures") or [""])[0]
        return cls(num_layers=layers, num_experts=experts, top_k=int(cfg["num_experts_per_tok"]), moe_layers=moe,
                   vocab_size=int(cfg["vocab_size"]), weight_version=weight_version, architecture=str(arch))

    def same_model(self, other: "ModelInfo") -> bool:
        keys = ("num_layers", "num_experts", "top_k", "moe_layers", "vocab_size", "architecture")
        return all(getattr(self, k) == getattr(other, k) for k in keys)


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

    def snapshot(self) -> dict:
        return {"alive": self.alive, "outstanding": self.outstanding, "completed": self.completed,
                "failures": self.failures, "retried_away": self.retried_away, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "last_error": self.last_error}


@dataclass(kw_only=True)
class Request:
    """One sample to generate. ``sampling_params`` must be JSON-ready; ``sampling_seed`` is filled in."""
    input_ids: list[int]
    sampling_params: dict
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    group_id: Any = None
    meta: dict = field(default_factory=dict)


class _ServerFailed(Exception):
    def __init__(self, message: str, *, dead: bool):
        super().__init__(message)
        self.dead = dead


class _Aborted(Exception):
    """A server returned the request aborted by someone else (pause/abort_all): submit it again."""


class RolloutClient:
    """Async client over ``rollout-serve`` URLs; see the module docstring.

    Args:
        urls: one URL or a list of them.
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

    def __init__(self, urls: Union[str, Sequence[str]], *, api_key: Optional[str] = None,
                 admin_api_key: Optional[str] = None, routing_format: str = "compact", stream: bool = False,
                 timeout: float = 600.0, connect_timeout: float = 10.0, max_attempts: Optional[int] = None,
                 max_concurrency: int = 512, validate: bool = True, return_routed_experts: bool = True,
                 retry_backoff_s: float = 0.05, health_timeout: float = 5.0,
                 transport: Optional[httpx.AsyncBaseTransport] = None, model_config: Optional[str] = None):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("RolloutClient needs at least one server URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"server URLs repeat: {urls}")
        if routing_format not in ROUTING_FORMATS:
            raise ValueError(f"routing_format must be one of {ROUTING_FORMATS}, got {routing_format!r}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.servers = [ServerState(u.rstrip("/"), i) for i, u in enumerate(urls)]
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.routing_format = routing_format
        self.stream = stream
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_attempts = max_attempts or max(3, 2 * len(urls))
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
        if self.info is None:
            self.info = await self.model_info()
        return self

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # ---- servers -----------------------------------------------------------------------------
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

    def _headers(self, admin: bool = False) -> dict:
        key = (self.admin_api_key or self.api_key) if admin else (self.api_key or self.admin_api_key)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _pick(self, exclude: set[str]) -> ServerState:
        live = [s for s in self.servers if s.alive]
        if not live:
            raise NoServerError("no live rollout server: " +
                                "; ".join(f"{s.url}: {s.last_error or 'dead'}" for s in self.servers))
        fresh = [s for s in live if s.url not in exclude] or live
        n = len(self.servers)
        best = min(fresh, key=lambda s: (s.outstanding, (s.index - self._rr) % n))
        self._rr = (best.index + 1) % n
        return best

    def loads(self) -> dict[str, dict]:
        """This client's view per server: alive, outstanding, completed, failures, bytes."""
        return {s.url: s.snapshot() for s in self.servers}

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

        async def one(rid: str):
            s = self._inflight.get(rid)
            if s is None:
                return 0
            try:
                r = await self._http.post(s.url + "/abort_request", json={"rid": rid}, headers=self._headers(),
                                          timeout=30)
                return int(r.json().get("num_aborted", 0)) if r.status_code == 200 else 0
            except (httpx.HTTPError, ValueError):
                return 0
        return sum(await asyncio.gather(*(one(r) for r in targets)))

    # ---- generation --------------------------------------------------------------------------
    def _body(self, req: Request) -> dict:
        body = {"input_ids": list(req.input_ids), "sampling_params": req.sampling_params, "rid": req.rid,
                "return_logprob": True, "return_routed_experts": self.return_routed_experts,
                "routed_experts_format": self.routing_format, "stream": self.stream}
        if self.stream:
            body["incremental_streaming_output"] = True  # SGLang ignores it and streams cumulative chunks
        return body

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
        sp = req.sampling_params
        sp.setdefault("sampling_seed", int.from_bytes(hashlib.sha256(req.rid.encode()).digest()[:7], "little"))
        sp.setdefault("n", 1)
        if sp["n"] != 1:
            raise ValueError(f"request {req.rid!r}: sampling_params.n must be 1 (one request per sample)")
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
                    sample = self._to_sample(req, raw, server, attempts, time.perf_counter() - t0, nbytes)
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

    # ---- transport ---------------------------------------------------------------------------
    def _check_status(self, server: ServerState, req: Request, status: int, text: str) -> None:
        if status < 400:
            return
        if status in _RETRY_STATUS:
            raise _ServerFailed(f"HTTP {status}: {text[:200]}", dead=status == 503)
        if status == 400 and _error_type(text) == RID_IN_FLIGHT:  # NOTE: our abort of a timed-out try is not done yet
            raise _ServerFailed(f"HTTP 400: {text[:200]}", dead=False)
        raise RequestRejected(f"request {req.rid!r} rejected by {server.url}: HTTP {status}: {text[:500]}")

    async def _open(self, server: ServerState, body: bytes) -> httpx.Response:
        """POSTs /generate; returns the response as soon as its headers arrived (the caller reads
        and closes it). Failures before any response byte are retried on a fresh connection."""
        request = self._http.build_request("POST", server.url + "/generate", content=body,
                                           headers={**self._headers(), "Content-Type": "application/json"})
        for retry in range(STALE_CONNECTION_RETRIES + 1):
            try:
                return await self._http.send(request, stream=True)
            except _STALE_CONNECTION_ERRORS:
                if retry == STALE_CONNECTION_RETRIES:
                    raise
                self.stale_retries += 1
        raise AssertionError("unreachable")

    async def _post(self, server: ServerState, req: Request) -> tuple[dict, int]:
        body = json.dumps(self._body(req)).encode()
        server.bytes_out += len(body)
        try:
            r = await self._open(server, body)
            try:
                await r.aread()
            finally:
                await r.aclose()
        except httpx.TimeoutException as exc:
            await self._abort_quietly(server, req.rid)
            raise _ServerFailed(f"timed out ({type(exc).__name__})", dead=False) from None
        except _TRANSPORT_ERRORS as exc:
            raise _ServerFailed(f"{type(exc).__name__}: {exc}", dead=not await self._healthy(server)) from None
        server.bytes_in += len(r.content)
        self._check_status(server, req, r.status_code, r.text)
        try:
            out = r.json()
        except ValueError:
            raise _ServerFailed("response is not JSON", dead=False) from None
        if isinstance(out, list):
            if len(out) != 1:
                raise SampleError(f"request {req.rid!r}: {server.url} returned {len(out)} outputs for one request")
            out = out[0]
        return out, len(r.content)

    async def _post_stream(self, server: ServerState, req: Request) -> tuple[dict, int]:
        body = json.dumps(self._body(req)).encode()
        server.bytes_out += len(body)
        out_ids: list[int] = []
        lps: list[float] = []
        rows: list[torch.Tensor] = []
        next_row = 0
        final: Optional[dict] = None
        text_parts: list[str] = []
        nbytes = 0
        try:
            r = await self._open(server, body)
            try:
                if r.status_code >= 400:
                    await r.aread()
                    self._check_status(server, req, r.status_code, r.text)
                async for line in r.aiter_lines():
                    nbytes += len(line) + 1
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        raise _ServerFailed(f"stream error: {str(ev['error'])[:200]}", dead=True)
                    meta = ev["meta_info"]
                    ids = ev.get("output_ids") or []
                    # NOTE: a cumulative chunk (SGLang's default) holds every token so far; an
                    # incremental one only the new ones (fewer than completion_tokens after the first)
                    if len(ids) == meta.get("completion_tokens", -1):
                        out_ids, lps, text_parts = [], [], []
                    out_ids.extend(ids)
                    text_parts.append(ev.get("text") or "")
                    lps.extend(lp for lp, _t, _x in meta.get("output_token_logprobs") or [])
                    if meta.get("routed_experts") is not None:
                        if "routed_experts_start" not in meta:  # the whole routing (cumulative streaming)
                            rows, next_row = [], 0
                        start = int(meta.get("routed_experts_start", next_row))
                        chunk = self._decode_routing(meta["routed_experts"], req, server)
                        if start != next_row:
                            raise SampleError(f"request {req.rid!r}: {server.url} streamed routing rows from "
                                              f"{start}, expected {next_row}")
                        rows.append(chunk)
                        next_row += chunk.shape[0]
                    if meta.get("finish_reason") is not None:
                        final = ev
            finally:
                await r.aclose()
        except httpx.TimeoutException as exc:
            await self._abort_quietly(server, req.rid)
            raise _ServerFailed(f"stream timed out ({type(exc).__name__})", dead=False) from None
        except _TRANSPORT_ERRORS as exc:
            raise _ServerFailed(f"stream cut off: {type(exc).__name__}: {exc}",
                                dead=not await self._healthy(server)) from None
        except json.JSONDecodeError:
            raise _ServerFailed("malformed SSE event", dead=False) from None
        server.bytes_in += nbytes
        if final is None:
            raise _ServerFailed("stream ended without a finished event", dead=False)
        meta = dict(final["meta_info"])
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out_ids)]
        meta.pop("routed_experts", None)
        out = {"text": "".join(text_parts), "output_ids": out_ids, "meta_info": meta}
        if rows:
            out["_routing"] = torch.cat(rows)
        return out, nbytes

    async def _healthy(self, server: ServerState) -> bool:
        """After a transport error: is the server still up? (A pooled keep-alive connection the
        server closed at the same moment gives the same errors as a dead server.)"""
        try:
            r = await self._http.get(server.url + "/health", timeout=self.health_timeout)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def _abort_quietly(self, server: ServerState, rid: str) -> None:
        try:
            await self._http.post(server.url + "/abort_request", json={"rid": rid}, headers=self._headers(),
                                  timeout=5)
        except httpx.HTTPError:
            pass

    # ---- decoding ----------------------------------------------------------------------------
    def _decode_routing(self, s: str, req: Request, server: ServerState) -> torch.Tensor:
        info = self.info
        try:
            # NOTE: by content, not by the format asked for: a server that ignores
            # routed_experts_format (real SGLang) answers int32
            fmt = "compact" if s.startswith(_COMPACT_B64) else "int32"
            return decode_routed_experts(s, fmt, num_layers=info.num_layers, top_k=info.top_k)
        except ValueError as exc:
            raise SampleError(f"sample {req.rid!r} from {server.url}: undecodable routed_experts: {exc}") from None

    def _to_sample(self, req: Request, out: dict, server: ServerState, attempts: int, latency: float,
                   nbytes: int) -> Sample:
        who = f"sample {req.rid!r} from {server.url}"
        try:
            meta = out["meta_info"]
            output_ids = [int(t) for t in out["output_ids"]]
            finish = meta["finish_reason"] or {}
            finish_type = finish.get("type") if isinstance(finish, dict) else str(finish)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SampleError(f"{who}: malformed response ({type(exc).__name__}: {exc})") from None
        if meta.get("id") not in (None, req.rid):
            raise SampleError(f"{who}: response is for rid {meta.get('id')!r}")
        if finish_type == "abort" and isinstance(finish, dict) and finish.get("err_type"):
            # NOTE: the server failed the request (e.g. non-finite logits): a failed attempt, not a pause
            raise _ServerFailed(f"request aborted by a server error: {str(finish.get('message'))[:200]}",
                                dead=False)
        if finish_type == "abort" and req.rid not in self._aborted:
            raise _Aborted()
        self._aborted.discard(req.rid)
        if meta.get("prompt_tokens") is not None and int(meta["prompt_tokens"]) != len(req.input_ids):
            raise SampleError(f"{who}: prompt_tokens {meta['prompt_tokens']} != {len(req.input_ids)} sent")
        lp_rows = meta.get("output_token_logprobs") or []
        if [int(t) for _lp, t, *_ in lp_rows] != output_ids:
            raise SampleError(f"{who}: output_token_logprobs do not match output_ids")
        lps = [float(lp) for lp, *_ in lp_rows]
        routed = None
        routing_bytes = 0
        if self.return_routed_experts:
            if "_routing" in out:
                routed = out["_routing"]
            elif finish_type == "abort" and not output_ids and isinstance(finish, dict) \
                    and finish.get("message") == ABORT_BEFORE_PREFILL:
                routed = None   # NOTE: aborted before any KV was computed: no routing row exists
            elif meta.get("routed_experts") is not None:
                routing_bytes = len(meta["routed_experts"])
                routed = self._decode_routing(meta["routed_experts"], req, server)
            else:
                raise SampleError(f"{who}: no routed_experts in the response (is the server started with "
                                  f"--enable-return-routed-experts?)")
            start = int(meta.get("routed_experts_start_len") or 0)
            if start != 0:
                raise SampleError(f"{who}: routed_experts_start_len {start}, expected 0")
        sample = Sample(prompt_ids=req.input_ids, response_ids=output_ids, rollout_logprobs=lps,
                        routed_experts=routed, weight_version=meta.get("weight_version"),
                        group_id=req.group_id, rid=req.rid,
                        meta={**req.meta, "finish_reason": finish_type, "server": server.url, "attempts": attempts,
                              "latency_s": latency, "wire_bytes": nbytes, "routing_bytes": routing_bytes,
                              "text": out.get("text", ""), "cached_tokens": meta.get("cached_tokens", 0)})
        if self.validate and routed is not None:
            info = self.info
            try:
                sample.validate(info.num_experts, info.num_layers, info.top_k,
                                list(info.moe_layers) if info.moe_layers else None)
            except ValueError as exc:
                raise SampleError(f"{exc} (from {server.url})") from None
        return sample


def _error_type(text: str) -> Optional[str]:
    """The `error.type` of a JSON error body, if it is one."""
    try:
        body = json.loads(text)
    except ValueError:
        return None
    err = body.get("error") if isinstance(body, dict) else None
    return err.get("type") if isinstance(err, dict) else None
