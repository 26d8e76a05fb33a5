"""ProcessClient: the engine in processes of its own (one per DP rank), over ZMQ.

One receiver thread reads every rank's messages and watches every rank's process: updates go
to the front end's callback, replies resolve the waiting calls. A rank that dies (crash, kill)
is noticed at once through its process sentinel; the other ranks get a short grace period to
deliver what they send on the way down (the partial outputs of their aborted requests), then
the front end hears `on_dead` and every waiting call raises EngineDeadError.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import zmq

from rollout.config import EngineConfig
from rollout.frontend.engine_client import DeadCallback, EngineDeadError, PendingCalls, UpdatesCallback
from rollout.ipc.messages import AbortReqs, AddReqs, Call, Fatal, Ready, ReqSpec, Shutdown, StepOut
from rollout.ipc.temp_dirs import remove_dirs_of, remove_stale_dirs
from rollout.ipc.transport import FrontSockets, IpcDirectory
from rollout.ipc.control_values import PEER_FAILED

logger = logging.getLogger(__name__)


PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class EngineProcess:
    """One engine process: `python -m rollout.core.engine_proc` with its settings as JSON.

    NOTE: a plain subprocess, not multiprocessing: spawn and forkserver re-run the caller's
    __main__ in the child, so a script without an `if __name__ == "__main__"` guard would start
    engines recursively. `sentinel` is the read end of a pipe whose only writer is the child:
    it becomes readable (EOF) when the child exits, however it exits.
    """

    def __init__(self, args: list[str], rank: int):
        read, write = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        # NOTE: the child inherits the signal mask: with SIGINT blocked while it is made, a Ctrl-C in its
        # first moments (before engine_proc ignores SIGINT and unblocks it) is dropped, not a
        # KeyboardInterrupt traceback from its interpreter's startup
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "rollout.core.engine_proc", *args, str(write)],
                                         pass_fds=(write,), env=env, close_fds=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(write)
        self.sentinel = read
        self.rank = rank
        self.pid = self.proc.pid

    @property
    def exitcode(self) -> Optional[int]:
        return self.proc.poll()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self.proc.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self.proc.kill()

    def close(self) -> None:
        try:
            os.close(self.sentinel)
        except OSError:
            pass


class ProcessClient:
    STARTUP_TIMEOUT_S = 600.0
    STOP_TIMEOUT_S = 10.0
    DEATH_GRACE_S = 2.0       # how long the other ranks may still deliver after one died

    def __init__(self, cfg: EngineConfig, on_updates: UpdatesCallback, on_dead: DeadCallback):
        self.cfg = cfg
        self.dp_size = cfg.dp_size
        self._on_updates = on_updates
        self._on_dead = on_dead
        self._dead: Optional[str] = None
        self._lock = threading.Lock()
        self._calls = PendingCalls(self.dp_size)
        self._owner: dict[int, int] = {}                 # uid -> rank
        self._load = [0] * self.dp_size
        self._steps = [0] * self.dp_size
        self._closed = False
        self._ctx = zmq.Context()
        remove_stale_dirs()
        self._dir = IpcDirectory()
        self._sockets = [FrontSockets(self._ctx, self._dir.path, r) for r in range(self.dp_size)]
        store_port = None
        self._store = None
        if self.dp_size > 1:
            import torch.distributed as dist  # noqa: PLC0415

            # NOTE: the DP rendezvous store listens on a port the OS picks (port 0), in this process
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store_port = self._store.port
        config = json.dumps({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
        self._procs: list[EngineProcess] = []
        try:
            for rank, socks in enumerate(self._sockets):
                self._procs.append(EngineProcess(
                    [config, str(rank), socks.to_engine_addr, socks.from_engine_addr, str(store_port or 0),
                     str(os.getpid())], rank))
            ready = self._await_ready()
        except BaseException:
            self.close()
            raise
        self.kv_capacity = min(r["kv_capacity"] for r in ready)
        self.context_length = ready[0]["context_length"]
        self._thread = threading.Thread(target=self._receive, name="rollout-engine-client", daemon=True)
        self._thread.start()

    # ---- startup -----------------------------------------------------------------------------
    def _await_ready(self) -> list[dict]:
        poller = zmq.Poller()
        for s in self._sockets:
            poller.register(s.pull, zmq.POLLIN)
        for p in self._procs:
            poller.register(p.sentinel, zmq.POLLIN)
        ready: dict[int, dict] = {}
        deadline = time.monotonic() + self.STARTUP_TIMEOUT_S
        while len(ready) < self.dp_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine did not start within {self.STARTUP_TIMEOUT_S:.0f} s")
            events = dict(poller.poll(500))
            for rank, s in enumerate(self._sockets):
                if s.pull in events:
                    msg = s.decoder.decode(s.pull.recv())
                    if isinstance(msg, Fatal):
                        raise _startup_error(msg.traceback)
                    assert isinstance(msg, Ready), msg
                    ready[rank] = msg.info
            for rank, p in enumerate(self._procs):
                if p.sentinel in events and rank not in ready and not self._sockets[rank].pull.poll(0):
                    raise RuntimeError(f"engine rank {rank} exited during startup with code {p.exitcode}")
        return [ready[r] for r in range(self.dp_size)]

    # ---- the receiver thread -------------------------------------------------------------------
    def _receive(self) -> None:
        poller = zmq.Poller()
        for s in self._sockets:
            poller.register(s.pull, zmq.POLLIN)
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        fatal: list[str] = []
        died_at: Optional[float] = None
        dead_ranks: list[int] = []
        try:
            while not self._closed:
                events = dict(poller.poll(200))
                for rank, s in enumerate(self._sockets):
                    if s.pull in events:
                        while True:
                            try:
                                data = s.pull.recv(zmq.NOBLOCK, copy=False)
                            except zmq.Again:
                                break
                            msg = s.decoder.decode(data.buffer)
                            if isinstance(msg, StepOut):
                                self._absorb(rank, msg)
                            elif isinstance(msg, Fatal):
                                fatal.append(msg.traceback)
                                logger.error("%s", msg.traceback)
                for fd, rank in sentinels.items():
                    if fd in events and rank not in dead_ranks:
                        poller.unregister(fd)
                        dead_ranks.append(rank)
                        died_at = died_at or time.monotonic()
                if died_at is not None and (self.dp_size == 1 or time.monotonic() - died_at > self.DEATH_GRACE_S
                                            or len(dead_ranks) == self.dp_size):
                    if not self._closed:
                        self._die(dead_ranks, fatal)
                    return
        except BaseException as exc:  # noqa: BLE001 (a bug here must not leave waiters hanging)
            logger.exception("engine client receiver failed")
            self._die([], [f"engine client receiver failed: {exc!r}"])

    def _absorb(self, rank: int, msg: StepOut) -> None:
        self._steps[rank] = msg.steps
        if msg.updates:
            with self._lock:
                for upd in msg.updates:
                    if upd.finished and self._owner.pop(upd.uid, None) is not None:
                        self._load[rank] -= 1
                    if upd.finish_message == PEER_FAILED:
                        upd.finish_message = self._dead_ranks_text() or upd.finish_message
            self._on_updates(msg.updates)
        for reply in msg.replies:
            self._calls.resolve(reply, rank)

    def _die(self, dead_ranks: list[int], fatal: list[str]) -> None:
        parts = []
        for rank in dead_ranks:
            p = self._procs[rank]
            p.join(timeout=1.0)
            parts.append(f"DP rank {rank} died (exit code {p.exitcode})" if self.dp_size > 1
                         else f"engine process exited with code {p.exitcode}")
        if fatal:
            parts.append(fatal[0].strip().splitlines()[-1])
        reason = "; ".join(parts) or "engine stopped"
        with self._lock:
            if self._dead is not None:
                return
            self._dead = reason
        self._calls.fail_all(reason)
        self._on_dead(reason)
        threading.Thread(target=self._stop_procs, daemon=True).start()

    def _dead_ranks_text(self) -> str:
        """The ranks that exited (a survivor aborts only after its peer is gone)."""
        return "; ".join(f"DP rank {p.rank} died (exit code {p.exitcode})" for p in self._procs
                         if p.exitcode is not None)

    # ---- EngineClient ------------------------------------------------------------------------
    @property
    def dead_reason(self) -> Optional[str]:
        """Set from the moment any rank has exited (the others may still be delivering)."""
        if self._dead is None and any(p.exitcode is not None for p in self._procs):
            return self._dead_ranks_text() or "an engine rank exited"
        return self._dead

    @property
    def steps_done(self) -> int:
        return max(self._steps)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _check(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _send(self, rank: int, msg: Any, check: bool = True) -> None:
        if not self._sockets[rank].send(msg) and check:
            raise EngineDeadError(self.dead_reason or f"engine rank {rank} is not connected")

    def _pick_rank(self, specs: list[ReqSpec]) -> int:
        return 0

    def add(self, groups: list[list[ReqSpec]]) -> None:
        self._check()
        by_rank: dict[int, list[ReqSpec]] = {}
        with self._lock:
            for specs in groups:
                rank = self._pick_rank(specs)
                for spec in specs:
                    self._owner[spec.uid] = rank
                self._load[rank] += len(specs)
                by_rank.setdefault(rank, []).extend(specs)
        for rank, specs in by_rank.items():
            self._send(rank, AddReqs(specs))

    def abort(self, uids: list[int], message: str = "aborted by request") -> None:
        if self._dead is not None or not uids:
            return
        with self._lock:
            by_rank: dict[int, list[int]] = {}
            for uid in uids:
                rank = self._owner.get(uid)
                if rank is not None:
                    by_rank.setdefault(rank, []).append(uid)
        for rank, ids in by_rank.items():
            self._send(rank, AbortReqs(ids, message), check=False)

    def call(self, method: str, *args: Any) -> list[Any]:
        self._check()
        call_id, futures = self._calls.open()
        try:
            self._check()
            for rank in range(self.dp_size):
                self._send(rank, Call(call_id, method, list(args)))
            return self._calls.wait(futures, self._check)
        finally:
            self._calls.close(call_id)

    # ---- lifecycle ---------------------------------------------------------------------------
    def _stop_procs(self) -> None:
        for s in self._sockets:
            try:
                s.send(Shutdown())
            except zmq.ZMQError:
                pass   # NOTE: closed already
        deadline = time.monotonic() + self.STOP_TIMEOUT_S
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        # NOTE: an engine killed while its weights were released (the OOM killer) leaves them on disk
        remove_dirs_of([p.pid for p in self._procs if not p.is_alive()])

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            if self._dead is None:
                self._dead = "engine is shut down"
        self._stop_procs()
        self._closed = True
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        for s in self._sockets:
            s.close()
        for p in self._procs:
            p.close()
        self._ctx.destroy(linger=0)   # NOTE: not term(): it would wait for any socket left open
        self._dir.close()


class DPClient(ProcessClient):
    """dp_size engine ranks: a prompt's requests go to the least-loaded rank (or the pinned one),
    commands to every rank."""

    def _pick_rank(self, specs: list[ReqSpec]) -> int:
        pinned = specs[0].routed_dp_rank
        if pinned is not None:
            return pinned
        return min(range(self.dp_size), key=lambda r: (self._load[r], r))


def _startup_error(text: str) -> BaseException:
    last = text.strip().splitlines()[-1]
    if last.startswith("ValueError: "):
        return ValueError(last[len("ValueError: "):])
    return RuntimeError(text)


