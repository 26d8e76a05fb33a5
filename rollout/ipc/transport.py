"""ZMQ transport between the front end and engine processes (PUSH/PULL).

The front end binds, the engine connects. A rank of the front end's own node talks over ipc://
socket files in a private temporary directory named after the front end's pid; a rank of another
node over tcp:// on the front end's address toward the rendezvous host, on ports the OS picks
(published through the rendezvous store: rollout/ipc/rendezvous.py). Over tcp:// both ends send
ZMTP heartbeats, and the front end watches its sockets' connections (`gone()`): a peer process
that dies closes them at once, a silent node is dropped after HEARTBEAT_TIMEOUT_MS. ZMQ sockets
are not thread-safe: FrontSockets.send takes a lock (callers send from several threads); only the
front end's receiver thread reads `pull` and the monitor.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from rollout.ipc.messages import Codec, FromEngine, ToEngine


def pid_alive(pid: int) -> bool:
    """Whether process pid still runs (an engine's check on its front end; stale temporary
    directories). A zombie (exited, not yet reaped: an orphan in a container whose init does not
    reap) is dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:   # NOTE: reaped between the two looks
        return False
    except OSError:             # NOTE: no procfs: os.kill's answer stands
        return True


HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10000


def _socket(ctx: zmq.Context, kind: int, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # NOTE: no high-water mark: a full queue would block the engine loop (or drop messages)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if endpoint.startswith("tcp://"):
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    return sock


class FrontSockets:
    """The front end's ends of one engine process's two channels, bound on `endpoint`: an ipc://
    path prefix ("-in" and "-out" are added) or "tcp://ADDRESS:*" (the OS picks the ports)."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self.remote = endpoint.startswith("tcp://")
        self.push = _socket(ctx, zmq.PUSH, endpoint)
        self.pull = _socket(ctx, zmq.PULL, endpoint)
        # NOTE: the engine's connection to its PULL socket closes when the engine process or its node is gone
        self.monitor = self.pull.get_monitor_socket(zmq.EVENT_DISCONNECTED) if self.remote else None
        self.push.bind(endpoint if self.remote else endpoint + "-in")
        self.pull.bind(endpoint if self.remote else endpoint + "-out")
        self.to_engine_addr = self.push.getsockopt_string(zmq.LAST_ENDPOINT)
        self.from_engine_addr = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
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

    def gone(self) -> bool:
        """Whether the engine's connection closed since the last look (tcp:// only; never blocks)."""
        if self.monitor is None:
            return False
        closed = False
        while self.monitor.poll(0):
            closed = recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED or closed
        return closed

    def close(self) -> None:
        if self.monitor is not None:
            self.pull.disable_monitor()
            self.monitor.close(linger=0)
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
        self.pull = _socket(self.ctx, zmq.PULL, to_engine_addr)
        self.pull.connect(to_engine_addr)
        self.push = _socket(self.ctx, zmq.PUSH, from_engine_addr)
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
