"""timed_protocol: uvicorn's httptools HTTP/1.1 protocol with read deadlines (slowloris).

uvicorn times out only idle keep-alive connections (after an answer): a connection that never sends
a byte, or sends a request's headers or body a byte at a time, stayed open indefinitely (19,900 such
connections took a server to its file-descriptor limit). Here a connection closes when:
  - it opened and sent no complete request headers within `timeout_s`;
  - a request's first byte arrived and its headers did not complete within `timeout_s`;
  - its headers completed and its body did not within `timeout_s`.
A request whose headers are in is being answered: the application reads its body; if the body then
misses its deadline, the connection closes and the application sees the client disconnect.
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def timed_protocol(timeout_s: float) -> type:
    """An HttpToolsProtocol class whose reads must finish within timeout_s (uvicorn.Config(http=...))."""

    class TimedHttpToolsProtocol(HttpToolsProtocol):
        _deadline: Optional[asyncio.TimerHandle] = None
        _reading = False      # a request's headers or body are being read

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._reading = True
            self._arm()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self._reading:       # the first byte of the next request on a kept-alive connection
                self._reading = True
                self._arm()
            super().data_received(data)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm()                 # the body's deadline (the request is answered from here on)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()   # NOTE: arms uvicorn's keep-alive timeout for the idle time
            self._reading = False

    return TimedHttpToolsProtocol
