"""Rendezvous: the TCP store where one server's engine ranks meet (torch.distributed's TCPStore).

The front end hosts it (on one node: a free loopback port; on many: --dist-init-addr, on node 0);
every engine rank of every node joins it to form the DP group (gloo on CPU, NCCL on GPU). It also
carries what the nodes tell each other at startup, under `rollout/`:

    rollout/node/<R>       node R's engine launcher joined ("<host> <pid>")
    rollout/rank/<r>       the front end's two tcp:// endpoints for global DP rank r of another node
                           ('["to engine", "from engine"]'), bound on an OS-picked port

NOTE: torch's process groups keep their keys under their own prefixes, so these do not collide.
"""
from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from typing import Optional

from rollout.config import EngineConfig
from rollout.value_range import check_host_port

LOOPBACK = "127.0.0.1"


def _node_key(node: int) -> str:
    return f"rollout/node/{node}"


def _rank_key(rank: int) -> str:
    return f"rollout/rank/{rank}"


def store_address(cfg: EngineConfig) -> tuple[str, int]:
    """(host, port) the store listens on: --dist-init-addr, else a free loopback port (0)."""
    if cfg.dist_init_addr is None:
        return LOOPBACK, 0
    return check_host_port("dist_init_addr", cfg.dist_init_addr)


def _await_listening(host: str, port: int, timeout_s: float) -> None:
    """Returns once host:port accepts a TCP connection; RuntimeError after timeout_s.
    NOTE: polled here rather than by TCPStore's own retries: those block in C++ (a Ctrl-C waits for
    them) and log every failed attempt."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(1.0, max(0.05, deadline - time.monotonic()))):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"cannot reach the rendezvous at {host}:{port} (--dist-init-addr) within "
                                   f"{timeout_s:g} s: {exc.strerror or exc}") from None
        time.sleep(0.2)


def connect(host: str, port: int, timeout_s: float, *, master: bool = False):
    """A TCPStore on host:port (hosting it when master); RuntimeError naming the address when it
    cannot listen there, or cannot reach it within timeout_s."""
    import torch.distributed as dist  # noqa: PLC0415

    if not master:
        _await_listening(host, port, timeout_s)
    try:
        return dist.TCPStore(host, port, is_master=master, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:   # DistNetworkError is a RuntimeError
        what = "listen on" if master else f"join within {timeout_s:g} s"
        raise RuntimeError(f"cannot {what} the rendezvous at {host}:{port} (--dist-init-addr): "
                           f"{str(exc).splitlines()[0]}") from None


class Rendezvous:
    """One side's handle on the store: `host(cfg)` on the front end, `join(cfg)` on node R > 0."""

    def __init__(self, store, host: str, port: int, timeout_s: float):
        self.store = store
        self.host = host
        self.port = port
        self.timeout_s = timeout_s

    @classmethod
    def hosted(cls, cfg: EngineConfig) -> "Rendezvous":
        host, port = store_address(cfg)
        store = connect(host, port, cfg.dist_timeout, master=True)
        return cls(store, host, store.port, cfg.dist_timeout)

    @classmethod
    def joined(cls, cfg: EngineConfig) -> "Rendezvous":
        host, port = store_address(cfg)
        return cls(connect(host, port, cfg.dist_timeout), host, port, cfg.dist_timeout)

    @property
    def address(self) -> str:
        """"host:port", as engine processes are told to join it."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    # ---- nodes ------------------------------------------------------------------------------------
    def announce_node(self, node: int) -> None:
        self.store.set(_node_key(node), f"{socket.gethostname()} {os.getpid()}")

    def nodes_joined(self, nodes: list[int]) -> list[int]:
        """Which of these nodes announced themselves (does not wait)."""
        return [n for n in nodes if self.store.check([_node_key(n)])]

    def alive(self) -> bool:
        """Whether the store (so the front end that hosts it) still answers."""
        try:
            self.store.check([_node_key(0)])
        except (RuntimeError, OSError):
            return False
        return True

    def close(self) -> None:
        """Drops this handle; the hosting side's store stops listening (the other nodes' launchers then
        know that the server is gone)."""
        self.store = None

    # ---- the front end's endpoints -------------------------------------------------------------------
    def publish_endpoints(self, rank: int, to_engine: str, from_engine: str) -> None:
        self.store.set(_rank_key(rank), json.dumps([to_engine, from_engine]))

    def endpoints(self, rank: int, timeout_s: Optional[float] = None) -> tuple[str, str]:
        """The front end's endpoints for DP rank `rank`, waiting for them up to timeout_s."""
        key = _rank_key(rank)
        try:
            self.store.wait([key], timedelta(seconds=timeout_s or self.timeout_s))
            to_engine, from_engine = json.loads(self.store.get(key))
        except (RuntimeError, OSError) as exc:
            raise RuntimeError(f"the front end at {self.address} did not publish DP rank {rank}'s endpoints: "
                               f"{str(exc).splitlines()[0]}") from None
        return to_engine, from_engine
