"""EngineNode: node R > 0 of a server that spans nodes (`rollout-serve --nnodes N --node-rank R`).

It serves no HTTP: it joins the rendezvous store node 0's front end hosts at --dist-init-addr,
says it joined, reads the front end's tcp:// endpoints for each of its global DP ranks
(R*k .. R*k+k-1, k = dp_size / nnodes), starts one engine process per rank and waits for them.
The front end drives those ranks as it drives its own (rollout/frontend/process_client.py).

It ends when its engines have ended: after the front end's Shutdown, or when the server is gone
(the store stops answering: the engines are then given STOP_GRACE_S to end on their own, which
they do once the DP group breaks, and killed after). An engine that fails makes it stop the others
and exit non-zero, naming the rank. SIGTERM/SIGINT: the first waits for node 0 to stop the
engines (a server's drain), a second one (a second or more later: a supervisor that signals both a
task and its process group delivers two at once) kills them.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import signal
import time
from typing import Optional

from rollout.config import EngineConfig
from rollout.frontend.engine_process import EngineProcess
from rollout.ipc.rendezvous import Rendezvous
from rollout.ipc.temp_dirs import remove_dirs_of

logger = logging.getLogger(__name__)


class EngineNode:
    POLL_S = 0.5
    STOP_GRACE_S = 15.0      # the engines' time to end once the server is gone
    FAILED_GRACE_S = 2.0     # the other engines' time to end once one failed
    REPEAT_S = 1.0           # a signal this soon after the first is the same request

    def __init__(self, cfg: EngineConfig):
        if cfg.node_rank == 0:
            raise ValueError("node_rank must be an integer in [1, nnodes - 1] for an engine-only node, got 0 "
                             "(node 0 runs the front end)")
        self.cfg = cfg
        self.procs: list[EngineProcess] = []
        self.signals = 0
        self.first_signal = 0.0
        self.message = ""

    @property
    def name(self) -> str:
        ranks = self.cfg.local_ranks
        return f"node {self.cfg.node_rank} (DP ranks {ranks[0]}-{ranks[-1]})" if len(ranks) > 1 else \
            f"node {self.cfg.node_rank} (DP rank {ranks[0]})"

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signals and time.monotonic() - self.first_signal < self.REPEAT_S:
            return
        self.signals += 1
        if self.signals == 1:
            self.first_signal = time.monotonic()
            logger.warning("%s: %s: waiting for node 0 to stop the engines (a second signal kills them)",
                           self.name, signal.Signals(signum).name)

    def run(self) -> int:
        """Starts this node's engines and waits for them; the exit status (0: they ended cleanly).
        RuntimeError when the rendezvous cannot be reached within dist_timeout."""
        cfg = self.cfg
        # NOTE: until the engines run, a signal ends the process at once (nothing to stop yet)
        rendezvous = Rendezvous.joined(cfg)
        previous: dict = {}
        try:
            rendezvous.announce_node(cfg.node_rank)
            endpoints = [rendezvous.endpoints(rank) for rank in cfg.local_ranks]
            config = json.dumps({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
            previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
            for rank, (to_engine, from_engine) in zip(cfg.local_ranks, endpoints):
                self.procs.append(EngineProcess(config, rank, to_engine, from_engine, rendezvous.address, os.getpid()))
            logger.info("%s: engines started (pids %s), rendezvous %s", self.name, [p.pid for p in self.procs],
                        rendezvous.address)
            return self._watch(rendezvous)
        finally:
            self._stop()
            rendezvous.close()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _watch(self, rendezvous: Rendezvous) -> int:
        gone_at: Optional[float] = None     # when the server (the store) stopped answering
        failed_at: Optional[float] = None   # when an engine exited non-zero
        while True:
            live = [p for p in self.procs if p.is_alive()]
            failed = [p for p in self.procs if p.exitcode not in (None, 0)]
            if failed and failed_at is None:
                failed_at = time.monotonic()
                self.message = "; ".join(f"DP rank {p.rank} exited with code {p.exitcode}" for p in failed)
            if not live:
                return 1 if failed else 0
            if failed_at is not None and time.monotonic() - failed_at > self.FAILED_GRACE_S:
                return 1
            if self.signals > 1:
                self.message = "killed by a second signal"
                return 1
            if gone_at is None and not rendezvous.alive():
                gone_at = time.monotonic()
                logger.info("%s: the server is gone; waiting for the engines to end", self.name)
            if gone_at is not None and time.monotonic() - gone_at > self.STOP_GRACE_S:
                self.message = f"the engines did not end within {self.STOP_GRACE_S:g} s of the server's end"
                return 1
            try:
                select.select([p.sentinel for p in live], [], [], self.POLL_S)
            except InterruptedError:
                pass

    def _stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5.0)
            p.close()
        # NOTE: an engine killed while its weights were released leaves them on disk
        remove_dirs_of([p.pid for p in self.procs if not p.is_alive()])
