"""``_Transport``: one ``/generate`` try on one server, plain or streamed (SSE), as a part of
``RolloutClient``.

A try ends in a response dict, or raises ``_ServerFailed`` (retry elsewhere; ``dead`` when the
server looks gone), ``RequestRejected`` or ``SampleError``. A failure before any response byte on
a pooled connection is sent again at once (``STALE_CONNECTION_RETRIES``) if the same server still
serves (a server its supervisor restarted on the same port must not take it); a timed-out try is
aborted on its server so that its rid is free again.
"""
from __future__ import annotations

import json
from typing import Awaitable, Callable, Optional

import httpx
import torch

from .errors import SampleError, _ServerFailed, check_status
from .model_info import ModelInfo
from .request import Request
from .response import decode_routing
from .server_state import ServerState
from .stream import StreamAssembler

_TRANSPORT_ERRORS = (httpx.TransportError,)  # connect/read/write errors, protocol errors, timeouts
# NOTE: a pooled keep-alive connection that the server closes just as a request is written to it
# fails with one of these before any response byte; the request is then sent again at once. (So does a
# non-streamed request whose server was killed: the check that the same server still serves tells them apart.)
_STALE_CONNECTION_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError)
STALE_CONNECTION_RETRIES = 2


class _Transport:
    """Requests to one server. Needs the client's ``_http``, keys, routing options and ``info``;
    counts ``stale_retries``."""

    _http: Optional[httpx.AsyncClient]
    api_key: Optional[str]
    admin_api_key: Optional[str]
    routing_format: str
    stream: bool
    return_routed_experts: bool
    info: Optional[ModelInfo]
    stale_retries: int
    _still_serving: Callable[[ServerState], Awaitable[bool]]   # from _Health

    def _headers(self, admin: bool = False) -> dict:
        key = (self.admin_api_key or self.api_key) if admin else (self.api_key or self.admin_api_key)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _body(self, req: Request) -> dict:
        return req.body(routing_format=self.routing_format, stream=self.stream,
                        return_routed_experts=self.return_routed_experts)

    def _decode_routing(self, s: str, req: Request, server: ServerState) -> torch.Tensor:
        return decode_routing(s, self.info, req.rid, server.url)

    async def _open(self, server: ServerState, body: bytes) -> httpx.Response:
        """POSTs /generate; returns the response as soon as its headers arrived (the caller reads
        and closes it). Failures before any response byte are retried on a fresh connection while
        the same server still serves (else raised: the caller's failure path marks it dead)."""
        request = self._http.build_request("POST", server.url + "/generate", content=body,
                                           headers={**self._headers(), "Content-Type": "application/json"})
        for retry in range(STALE_CONNECTION_RETRIES + 1):
            try:
                return await self._http.send(request, stream=True)
            except _STALE_CONNECTION_ERRORS:
                if retry == STALE_CONNECTION_RETRIES or not await self._still_serving(server):
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
        except _TRANSPORT_ERRORS as exc:
            raise await self._failed_try(server, req.rid, exc, stream=False) from None
        server.bytes_in += len(r.content)
        check_status(server.url, req.rid, r.status_code, r.text)
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
        sse = StreamAssembler(lambda s: self._decode_routing(s, req, server), req.rid, server.url)
        try:
            r = await self._open(server, body)
            try:
                if r.status_code >= 400:
                    await r.aread()
                    check_status(server.url, req.rid, r.status_code, r.text)
                async for line in r.aiter_lines():
                    if not sse.feed(line):
                        break
            finally:
                await r.aclose()
        except _TRANSPORT_ERRORS as exc:
            raise await self._failed_try(server, req.rid, exc, stream=True) from None
        except json.JSONDecodeError:
            raise _ServerFailed("malformed SSE event", dead=False) from None
        server.bytes_in += sse.nbytes
        return sse.result(), sse.nbytes

    async def _failed_try(self, server: ServerState, rid: str, exc: httpx.TransportError, *,
                          stream: bool) -> _ServerFailed:
        """The failure of a try that raised ``exc``: a timeout (the try is aborted on its server,
        which stays live) or a transport error (dead unless the same server still answers)."""
        if isinstance(exc, httpx.TimeoutException):
            await self._abort_quietly(server, rid)
            return _ServerFailed(f"{'stream ' if stream else ''}timed out ({type(exc).__name__})", dead=False)
        return _ServerFailed(f"{'stream cut off: ' if stream else ''}{type(exc).__name__}: {exc}",
                             dead=not await self._still_serving(server))

    async def _abort_quietly(self, server: ServerState, rid: str) -> None:
        try:
            await self._http.post(server.url + "/abort_request", json={"rid": rid}, headers=self._headers(),
                                  timeout=5)
        except httpx.HTTPError:
            pass
