"""ZMQ transport between the front end and engine processes (PUSH/PULL over ipc:// sockets).

The front end binds, the engine connects. Socket files live in a private temporary directory
named after the front end's pid; nothing listens on a TCP port. ZMQ sockets are not thread-safe:
FrontSockets.send takes a lock (callers send from several threads); only the front end's
receiver thread reads `pull`.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Optional

import zmq

from rollout.ipc.messages import Codec, FromEngine, ToEngine


def pid_alive(pid: int) -> bool:
    """Whether process pid still runs (an engine's check on its front end; stale socket directories)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # NOTE: no high-water mark: a full queue would block the engine loop (or drop messages)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


class FrontSockets:
    """The front end's ends of one engine process's two channels."""

    def __init__(self, ctx: zmq.Context, directory: str, rank: int):
        self.to_engine_addr = f"ipc://{directory}/r{rank}-in"
        self.from_engine_addr = f"ipc://{directory}/r{rank}-out"
        self.push = _socket(ctx, zmq.PUSH)
        self.push.bind(self.to_engine_addr)
        self.pull = _socket(ctx, zmq.PULL)
        self.pull.bind(self.from_engine_addr)
        self._lock = threading.Lock()
        self._codec = Codec()
        self.decoder = Codec().from_engine   # the receiver thread's own

    def send(self, msg: ToEngine) -> bool:
        """False when the engine is not connected (it died): a PUSH socket without a peer would block.
        NOTE: no high-water mark, so a connected engine never makes this fail."""
        with self._lock:
            try:
                self.push.send(self._codec.encoder.encode(msg), zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
        return True

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)


class IpcDirectory:
    """A private directory for the socket files, removed on close."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix=f"rollout-{os.getpid()}-")

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class EngineSockets:
    """The engine process's ends (implements EngineEndpoint)."""

    def __init__(self, to_engine_addr: str, from_engine_addr: str):
        self.ctx = zmq.Context()
        self.pull = _socket(self.ctx, zmq.PULL)
        self.pull.connect(to_engine_addr)
        self.push = _socket(self.ctx, zmq.PUSH)
        self.push.connect(from_engine_addr)
        self._codec = Codec()

    def recv(self, timeout: float) -> list[ToEngine]:
        out: list[ToEngine] = []
        if timeout > 0 and not self.pull.poll(int(timeout * 1000)):
            return out
        while True:
            try:
                data = self.pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            out.append(self._codec.to_engine.decode(data.buffer))

    def send(self, msg: FromEngine) -> None:
        self.push.send(self._codec.encoder.encode(msg), copy=False)

    def close(self, linger_ms: Optional[int] = 2000) -> None:
        # NOTE: linger so the last messages (a Fatal, the final StepOut) reach the front end
        self.push.close(linger=linger_ms)
        self.pull.close(linger=0)
        self.ctx.term()
