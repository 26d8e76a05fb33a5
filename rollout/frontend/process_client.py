"""ProcessClient: the engine in processes of its own (one per DP rank), over ZMQ.

The ranks meet at a rendezvous store this front end hosts (rollout/ipc/rendezvous.py). With
nnodes > 1 the front end runs on node 0 and starts node 0's ranks; the other nodes' launchers
(rollout/frontend/engine_node.py) start theirs, which connect over tcp:// to endpoints published
in the store. Every rank is driven the same way whichever node runs it.

One receiver thread reads every rank's messages and watches every rank: a rank of this node
through its process sentinel, a rank of another node through its connection. Updates go to the
front end's callback, replies resolve the waiting calls. A rank that dies (crash, kill, a lost
node) is noticed at once; the other ranks get a short grace period to deliver what they send on
the way down (the partial outputs of their aborted requests), then the front end hears `on_dead`
and every waiting call raises EngineDeadError.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any, Optional

import zmq

from rollout.config import EngineConfig
from rollout.frontend.engine_client import DeadCallback, EngineDeadError, PendingCalls, UpdatesCallback
from rollout.frontend.engine_process import EngineProcess
from rollout.ipc.control_values import PEER_FAILED
from rollout.ipc.messages import AbortReqs, AddReqs, Call, Fatal, Ready, ReqSpec, Shutdown, StepOut
from rollout.ipc.node_address import NodeAddress
from rollout.ipc.rendezvous import Rendezvous
from rollout.ipc.temp_dirs import remove_dirs_of, remove_stale_dirs
from rollout.ipc.transport import FrontSockets, IpcDirectory

logger = logging.getLogger(__name__)


class ProcessClient:
    STARTUP_TIMEOUT_S = 600.0
    STOP_TIMEOUT_S = 10.0
    FAILED_START_STOP_S = 1.0   # a failed startup: the ranks still loading or joining cannot take Shutdown
    DEATH_GRACE_S = 2.0       # how long the other ranks may still deliver after one died

    def __init__(self, cfg: EngineConfig, on_updates: UpdatesCallback, on_dead: DeadCallback):
        if cfg.node_rank != 0:
            raise ValueError(f"node_rank must be 0 for the front end (node 0 serves; node {cfg.node_rank} runs only "
                             f"its engine processes: `rollout-serve --node-rank {cfg.node_rank}`), got {cfg.node_rank}")
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
        self._gone: dict[int, float] = {}               # rank of another node -> when its connection closed
        # survivors' aborts (PEER_FAILED) that came before their lost peer was seen, and every update
        # after them, in order: delivered once the peer is named (_release_held)
        self._held: list = []
        self._stop_timeout_s = self.STOP_TIMEOUT_S
        remove_stale_dirs()
        self._dir = IpcDirectory()
        self._sockets: list[FrontSockets] = []
        self._procs: list[EngineProcess] = []
        self._rendezvous: Optional[Rendezvous] = None
        try:
            if self.dp_size > 1:
                # NOTE: the DP rendezvous store listens in this process: at --dist-init-addr, or on one
                # node at a loopback port the OS picks
                self._rendezvous = Rendezvous.hosted(cfg)
                self._rendezvous.announce_node(cfg.node_rank)
            remote = NodeAddress.toward(self._rendezvous.host) if cfg.nnodes > 1 else None
            for rank in range(self.dp_size):
                if rank in cfg.local_ranks:
                    socks = FrontSockets(self._ctx, f"ipc://{self._dir.path}/r{rank}")
                else:
                    socks = FrontSockets(self._ctx, remote.zmq_endpoint())
                    self._rendezvous.publish_endpoints(rank, socks.to_engine_addr, socks.from_engine_addr)
                self._sockets.append(socks)
            config = json.dumps({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
            store = self._rendezvous.address if self._rendezvous is not None else None
            for rank in cfg.local_ranks:
                socks = self._sockets[rank]
                self._procs.append(EngineProcess(config, rank, socks.to_engine_addr, socks.from_engine_addr, store,
                                                 os.getpid()))
            ready = self._await_ready()
        except BaseException:
            self._stop_timeout_s = self.FAILED_START_STOP_S
            self.close()
            raise
        self.kv_capacity = min(r["kv_capacity"] for r in ready)
        self.context_length = ready[0]["context_length"]
        self._thread = threading.Thread(target=self._receive, name="rollout-engine-client", daemon=True)
        self._thread.start()

    # ---- startup -----------------------------------------------------------------------------
    def _await_ready(self) -> list[dict]:
        cfg = self.cfg
        poller = zmq.Poller()
        for s in self._sockets:
            poller.register(s.pull, zmq.POLLIN)
        for p in self._procs:
            poller.register(p.sentinel, zmq.POLLIN)
        ready: dict[int, dict] = {}
        start = time.monotonic()
        deadline = start + self.STARTUP_TIMEOUT_S
        others = [n for n in range(cfg.nnodes) if n != cfg.node_rank]
        while len(ready) < self.dp_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine did not start within {self.STARTUP_TIMEOUT_S:.0f} s")
            if others:
                joined = self._rendezvous.nodes_joined(others)
                others = [n for n in others if n not in joined]
                if others and time.monotonic() - start > cfg.dist_timeout:
                    raise RuntimeError(f"{_nodes_text(cfg, others)} did not join the rendezvous at "
                                       f"{self._rendezvous.address} within {cfg.dist_timeout} s (--dist-timeout): "
                                       f"start `rollout-serve` there with the same flags and --node-rank")
            events = dict(poller.poll(500))
            for rank, s in enumerate(self._sockets):
                if s.pull in events:
                    msg = s.decoder.decode(s.pull.recv())
                    if isinstance(msg, Fatal):
                        raise _startup_error(msg.traceback)
                    assert isinstance(msg, Ready), msg
                    ready[rank] = msg.info
                if s.gone() and rank not in ready:
                    raise RuntimeError(f"{_nodes_text(cfg, [cfg.node_of(rank)])}: DP rank {rank} left during startup")
            for p in self._procs:
                if p.sentinel in events and p.rank not in ready and not self._sockets[p.rank].pull.poll(0):
                    raise RuntimeError(f"engine rank {p.rank} exited during startup with code {p.exitcode}")
        return [ready[r] for r in range(self.dp_size)]

    # ---- the receiver thread -------------------------------------------------------------------
    def _receive(self) -> None:
        poller = zmq.Poller()
        for s in self._sockets:
            poller.register(s.pull, zmq.POLLIN)
            if s.monitor is not None:
                poller.register(s.monitor, zmq.POLLIN)
        sentinels = {p.sentinel: p.rank for p in self._procs}
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        fatal: list[str] = []
        died_at: Optional[float] = None
        dead_ranks: list[int] = []
        try:
            while not self._closed:
                events = dict(poller.poll(200))
                # NOTE: lost connections first: the survivors' aborts (PEER_FAILED) then name the lost node
                for rank, s in enumerate(self._sockets):
                    if s.monitor is not None and s.monitor in events and s.gone() and rank not in dead_ranks:
                        poller.unregister(s.monitor)
                        self._gone[rank] = time.monotonic()
                        dead_ranks.append(rank)
                        died_at = died_at or time.monotonic()
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
                if self._held and (dead_ranks or self._dead_ranks_text()):
                    self._release_held()
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
                # NOTE: a survivor's collective can fail before the lost peer's connection event
                # arrives: its aborts wait until the peer can be named
                hold = bool(self._held) or (any(u.finish_message == PEER_FAILED for u in msg.updates)
                                            and not self._dead_ranks_text())
                if hold:
                    self._held.extend(msg.updates)
            if not hold:
                self._name_peer(msg.updates)
                self._on_updates(msg.updates)
        for reply in msg.replies:
            self._calls.resolve(reply, rank)

    def _name_peer(self, updates: list) -> None:
        text = self._dead_ranks_text()
        for upd in updates:
            if upd.finish_message == PEER_FAILED and text:
                upd.finish_message = text

    def _release_held(self) -> None:
        """Delivers the held updates (a lost peer has been seen, or the client dies)."""
        with self._lock:
            held, self._held = self._held, []
        if held:
            self._name_peer(held)
            self._on_updates(held)

    def _die(self, dead_ranks: list[int], fatal: list[str]) -> None:
        for p in self._procs:
            if p.rank in dead_ranks:
                p.join(timeout=1.0)
        self._release_held()
        parts = [self._dead_ranks_text(dead_ranks)] if dead_ranks else []
        if fatal:
            parts.append(fatal[0].strip().splitlines()[-1])
        reason = "; ".join(p for p in parts if p) or "engine stopped"
        with self._lock:
            if self._dead is not None:
                return
            self._dead = reason
        self._calls.fail_all(reason)
        self._on_dead(reason)
        threading.Thread(target=self._stop_procs, daemon=True).start()

    def _dead_ranks_text(self, ranks: Optional[list[int]] = None) -> str:
        """The ranks that exited (a survivor aborts only after its peer is gone): this node's by their
        exit codes, another node's as that node gone. ranks: those to name (default: every one gone)."""
        parts = []
        for p in self._procs:
            if p.exitcode is not None and (ranks is None or p.rank in ranks):
                parts.append(f"DP rank {p.rank} died (exit code {p.exitcode})" if self.dp_size > 1
                             else f"engine process exited with code {p.exitcode}")
        lost = sorted(r for r in self._gone if ranks is None or r in ranks)
        nodes = sorted({self.cfg.node_of(r) for r in lost})
        for node in nodes:
            parts.append(f"{_nodes_text(self.cfg, [node])} is gone (its connection closed)")
        return "; ".join(parts)

    # ---- EngineClient ------------------------------------------------------------------------
    @property
    def dead_reason(self) -> Optional[str]:
        """Set from the moment any rank has exited (the others may still be delivering)."""
        if self._dead is None and (self._gone or any(p.exitcode is not None for p in self._procs)):
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
        # NOTE: another node's ranks get Shutdown too; its launcher ends when they have exited
        for s in self._sockets:
            try:
                s.send(Shutdown())
            except zmq.ZMQError:
                pass   # NOTE: closed already
        deadline = time.monotonic() + self._stop_timeout_s
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
        if self._rendezvous is not None:
            self._rendezvous.close()


class DPClient(ProcessClient):
    """dp_size engine ranks: a prompt's requests go to the least-loaded rank (or the pinned one),
    commands to every rank."""

    def _pick_rank(self, specs: list[ReqSpec]) -> int:
        pinned = specs[0].routed_dp_rank
        if pinned is not None:
            return pinned
        return min(range(self.dp_size), key=lambda r: (self._load[r], r))


def _nodes_text(cfg: EngineConfig, nodes: list[int]) -> str:
    """"node 1 (DP ranks 2-3)", "nodes 1, 2 (DP ranks 2-5)": how a message names other nodes."""
    ranks = [r for n in sorted(nodes) for r in range(n * cfg.local_dp_size, (n + 1) * cfg.local_dp_size)]
    span = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"{ranks[0]}"
    word = "node" if len(nodes) == 1 else "nodes"
    return f"{word} {', '.join(map(str, sorted(nodes)))} (DP rank{'s' if len(ranks) > 1 else ''} {span})"


def _startup_error(text: str) -> BaseException:
    last = text.strip().splitlines()[-1]
    if last.startswith("ValueError: "):
        return ValueError(last[len("ValueError: "):])
    return RuntimeError(text)


