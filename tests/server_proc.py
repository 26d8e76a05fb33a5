"""Starts a real `rollout-serve` process on a free loopback port and waits for /health."""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import httpx

from rollout.ipc.transport import pid_alive  # noqa: F401  (the tests' one check of a pid)
from trainer_bridge.launch import LocalServer

ROOT = Path(__file__).resolve().parent.parent


class ServerProcess:
    """`with ServerProcess([...flags]) as srv:` -> srv.url; one `rollout-serve` on a free loopback
    port (trainer_bridge.launch.LocalServer), stopped on exit and its log removed."""

    def __init__(self, flags: Sequence[str] = (), *, startup_timeout: float = 120.0, env: Optional[dict] = None):
        log = tempfile.NamedTemporaryFile("w", prefix="rollout-serve-", suffix=".log", delete=False)
        log.close()
        self._server = LocalServer(["--log-level", "warning", *flags], Path(log.name),
                                   env={"OMP_NUM_THREADS": "2", **(env or {})})
        self.startup_timeout = startup_timeout

    @property
    def url(self) -> str:
        return self._server.url

    @property
    def alive(self) -> bool:
        return self._server.alive

    def log(self) -> str:
        return self._server.log()

    def start(self) -> "ServerProcess":
        self._server.spawn()
        deadline = time.monotonic() + self.startup_timeout
        try:
            while not self._server.poll_ready():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rollout-serve not ready in {self.startup_timeout}s:\n{self.log()}")
                time.sleep(0.05)
        except BaseException:
            self._server.stop()
            raise
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self._server.log_path.unlink(missing_ok=True)


class NodeProcess:
    """`rollout-serve --node-rank R ...` (an engine-only node of a server that spans nodes: no HTTP)
    in a process group of its own, its output in a temporary log; `netns`: run it inside that network
    namespace (`ip netns exec`)."""

    def __init__(self, flags: Sequence[str], *, netns: Optional[str] = None, env: Optional[dict] = None):
        import os

        self.flags = ["--log-level", "info", *flags]
        self.netns = netns
        self.env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    "OMP_NUM_THREADS": "2", **(env or {})}
        self.proc = None
        log = tempfile.NamedTemporaryFile("w", prefix="rollout-node-", suffix=".log", delete=False)
        log.close()
        self.log_path = Path(log.name)

    def start(self) -> "NodeProcess":
        import subprocess

        wrap = ["ip", "netns", "exec", self.netns] if self.netns else []
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([*wrap, sys.executable, "-m", "rollout.server", *self.flags], cwd=str(ROOT),
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill_tree(self) -> None:
        """SIGKILL to every process of its group (the launcher and its engines)."""
        import os
        import signal

        os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self, timeout: float = 20.0) -> None:
        import os
        import signal
        import subprocess

        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)

    def remove_log(self) -> None:
        self.log_path.unlink(missing_ok=True)


def wait_idle(client: httpx.Client, timeout: float = 30.0) -> dict:
    """Polls /v1/loads until nothing runs or waits; returns the load entry."""
    deadline = time.monotonic() + timeout
    while True:
        load = client.get("/v1/loads").json()["loads"][0]
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout}s: {load}")
        time.sleep(0.02)


def sse_events(response: httpx.Response):
    """JSON objects of an SSE response (skips comments), stopping at [DONE]."""
    import json

    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_main(url: str, admin_key: str, weights_file: str, out_path: str) -> None:
    """A trainer process: joins the server's weights update group as rank 0 and broadcasts tensors
    while the HTTP calls run, exactly as SGLang-based trainers do. Writes each step's answer to out_path."""
    import datetime
    import json
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from trainer_bridge.weight_sync import init_custom_process_group

    tensors = load_file(weights_file)
    headers = {"Authorization": f"Bearer {admin_key}"}
    results = {}

    def post(path, body):
        r = httpx.post(url + path, json=body, headers=headers, timeout=120)
        return [r.status_code, r.json()]

    port = free_port()
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(post, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "rollout-test", "backend": "gloo"})
        pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "rollout-test",
                                       datetime.timedelta(seconds=60))
        results["init"] = fut.result()
        names = sorted(tensors)
        fut = ex.submit(post, "/update_weights_from_distributed", {
            "names": names, "dtypes": [str(tensors[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(tensors[n].shape) for n in names], "weight_version": "v-dist"})
        for n in names:
            dist.broadcast(tensors[n].contiguous(), src=0, group=pg)
        results["update"] = fut.result()
        fut = ex.submit(post, "/update_weights_from_distributed", {
            "names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[3, 3]], "weight_version": "v-bad"})
        dist.broadcast(torch.zeros(3, 3), src=0, group=pg)
        results["wrong_shape"] = fut.result()
    results["destroy"] = post("/destroy_weights_update_group", {"group_name": "rollout-test"})
    dist.destroy_process_group(pg)
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "trainer":
    trainer_main(*sys.argv[2:6])
