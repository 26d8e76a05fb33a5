"""EngineProcess: one engine process (`python -m rollout.core.engine_proc`), started by the front end
for each DP rank of its node, or by a node's launcher (rollout/frontend/engine_node.py) for the
ranks of another node of a many-node server."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Optional

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class EngineProcess:
    """One engine process: `python -m rollout.core.engine_proc` with its settings as JSON.

    NOTE: a plain subprocess, not multiprocessing: spawn and forkserver re-run the caller's
    __main__ in the child, so a script without an `if __name__ == "__main__"` guard would start
    engines recursively. `sentinel` is the read end of a pipe whose only writer is the child:
    it becomes readable (EOF) when the child exits, however it exits.
    """

    def __init__(self, config_json: str, rank: int, to_engine_addr: str, from_engine_addr: str,
                 rendezvous: Optional[str], parent_pid: int):
        """rank: the global DP rank; rendezvous: the store's "host:port" (None: one rank, no DP group);
        parent_pid: the process whose exit orphans it (the front end, or its node's launcher)."""
        args = [config_json, str(rank), to_engine_addr, from_engine_addr, rendezvous or "-", str(parent_pid)]
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
