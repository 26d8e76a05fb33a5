"""Start ``rollout-serve`` subprocesses on free loopback ports for a training run (or a test).

``LocalServers(n, flags)`` starts ``n`` servers concurrently (``--port 0``: each server binds a free
port and prints it), waits for ``/health`` and stops them on ``close()`` (SIGTERM, then SIGKILL of
the process group). Logs go to files under ``log_dir``. It supervises them: a server that exits on
its own (rollout-serve exits non-zero when its engine dies) is started again on the same port; the
trainer's next weight sync gives it the current weights before the client sends it requests again.
The servers share the host's CPUs (``--cpu-threads`` = usable CPUs / n unless the flags set it).
"""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import httpx

__all__ = ["LocalServer", "LocalServers"]

logger = logging.getLogger(__name__)
_LISTENING = re.compile(r"rollout-serve listening on (http://\S+)")
_ROOT = Path(__file__).resolve().parent.parent


def _serve_command() -> list[str]:
    exe = Path(sys.executable).parent / "rollout-serve"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "rollout.server"]


class LocalServer:
    def __init__(self, flags: Sequence[str], log_path: Path, *, env: Optional[dict] = None):
        self.flags = list(flags)
        self.log_path = Path(log_path)
        self.env = env
        self.url = ""
        self.proc: Optional[subprocess.Popen] = None
        self._log = None
        self.restarts = 0
        self.stopping = False

    def spawn(self, port: int = 0) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(self.env or {})
        self._log = open(self.log_path, "a" if port else "w")
        cmd = _serve_command() + ["--host", "127.0.0.1", "--port", str(port)] + self.flags
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(_ROOT), env=env,
                                     start_new_session=True)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def poll_ready(self) -> bool:
        """True once /health answers; RuntimeError if the process exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"rollout-serve exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
        if not self.url:
            m = _LISTENING.search(self.log())
            if not m:
                return False
            self.url = m.group(1)
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def restart(self) -> None:
        """Starts an exited server again on the port it had (its URL stays valid)."""
        if self._log is not None:
            self._log.close()
        self.restarts += 1
        self.spawn(port=int(self.url.rsplit(":", 1)[1]))

    def kill(self) -> None:
        """SIGKILL the server (simulates a crash)."""
        if self.alive:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
        self.stopping = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None


def share_cpus(flags: list[str], n: int) -> list[str]:
    """flags with `--cpu-threads` = the usable CPUs / n when n servers share this host and the flags
    do not set it (a GPU engine ignores it). Each CPU engine would otherwise run one torch thread
    per CPU: n busy engines then hold n times as many OpenMP threads as there are CPUs, and a
    team whose thread is preempted waits at every barrier (two busy tiny-model servers on 2 CPUs
    measured 5-70 tok/s each, against 400-600 with one thread each)."""
    if n < 2 or any(f == "--cpu-threads" or f.startswith("--cpu-threads=") for f in flags):
        return flags
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return flags + ["--cpu-threads", str(max(1, usable // n))]


class LocalServers:
    """``n`` local ``rollout-serve`` processes with the same ``flags``; ``.urls`` once started."""

    SUPERVISE_INTERVAL_S = 0.5

    PROGRESS_EVERY_S = 10.0

    def __init__(self, n: int, flags: Sequence[str], *, log_dir: Optional[str] = None,
                 startup_timeout: float = 300.0, env: Optional[dict] = None, supervise: bool = True,
                 progress: Optional[Callable[[str], None]] = None):
        if n < 1:
            raise ValueError(f"need at least one server, got {n}")
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="rollout-servers-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        flags = share_cpus(list(flags), n)
        self.servers = [LocalServer(flags, self.log_dir / f"server{i}.log", env=env) for i in range(n)]
        self.startup_timeout = startup_timeout
        self.supervise = supervise
        self.progress = progress
        self._stop = threading.Event()
        self._supervisor: Optional[threading.Thread] = None

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def start(self) -> "LocalServers":
        """Starts the servers and waits until each answers /health; with ``progress``, says so as
        each starts and becomes ready, and every PROGRESS_EVERY_S while any is still loading."""
        say = self.progress or (lambda _: None)
        try:
            for i, s in enumerate(self.servers):
                s.spawn()
                say(f"  rollout-serve {i}: pid {s.proc.pid}, loading the model (log: {s.log_path})")
            t0 = time.monotonic()
            deadline, next_say = t0 + self.startup_timeout, t0 + self.PROGRESS_EVERY_S
            pending = list(self.servers)
            while pending:
                still = []
                for s in pending:
                    if s.poll_ready():
                        say(f"  rollout-serve {self.servers.index(s)}: ready at {s.url} after "
                            f"{time.monotonic() - t0:.1f}s")
                    else:
                        still.append(s)
                pending = still
                now = time.monotonic()
                if pending and now > deadline:
                    raise RuntimeError(f"rollout-serve did not become healthy in {self.startup_timeout}s:\n"
                                       + pending[0].log()[-3000:])
                if pending and now >= next_say:
                    next_say = now + self.PROGRESS_EVERY_S
                    say(f"  waiting for {len(pending)} rollout-serve process(es) to load the model "
                        f"({now - t0:.0f}s)")
                if pending:
                    time.sleep(0.1)
        except BaseException:
            self.close()
            raise
        if self.supervise:
            self._supervisor = threading.Thread(target=self._watch, name="rollout-servers-supervisor", daemon=True)
            self._supervisor.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.SUPERVISE_INTERVAL_S):
            for s in self.servers:
                if not s.stopping and s.proc is not None and s.proc.poll() is not None:
                    code = s.proc.returncode
                    s.restart()
                    logger.warning("rollout-serve %s exited with %s; restarted it on the same port (restart %d)",
                                   s.url, code, s.restarts)

    def close(self) -> None:
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        for s in self.servers:
            s.stop()

    def __enter__(self) -> "LocalServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
