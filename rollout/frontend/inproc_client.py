"""InprocClient: the engine loop on a thread of this process (tests and debugging).

The same EngineLoop and messages as an engine process, without serialization; `debug(fn)` runs
fn(core) on the engine thread between steps. On CPU, keep heavy torch work out of other threads
of this process: libgomp throttles every OpenMP pool once more OpenMP threads exist than CPUs.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

from rollout.config import EngineConfig
from rollout.core.engine_proc import EngineLoop
from rollout.core.engine_core import EngineCore
from rollout.frontend.engine_client import DeadCallback, EngineDeadError, PendingCalls, UpdatesCallback
from rollout.ipc.messages import AbortReqs, AddReqs, Call, FromEngine, ReqSpec, Shutdown, StepOut, ToEngine


class _QueueEndpoint:
    def __init__(self, client: "InprocClient"):
        self.inbox: "queue.Queue[Any]" = queue.Queue()
        self.client = client

    def recv(self, timeout: float) -> list[ToEngine]:
        out = []
        try:
            out.append(self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait())
            while True:
                out.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        debug = [m for m in out if callable(m)]
        for fn in debug:
            fn()
        return [m for m in out if not callable(m)]

    def send(self, msg: FromEngine) -> None:
        self.client._absorb(msg)


class InprocClient:
    def __init__(self, cfg: EngineConfig, on_updates: UpdatesCallback, on_dead: DeadCallback):
        if cfg.dp_size > 1:
            raise ValueError(f"dp_size={cfg.dp_size}: the in-process client runs one rank; use the process client")
        if cfg.cpu_affinity:
            raise ValueError(f"cpu_affinity={list(cfg.cpu_affinity)} pins an engine process; the in-process client "
                             f"has none (it would pin the caller): use the process client")
        self.dp_size = 1
        self._on_updates = on_updates
        self._on_dead = on_dead
        self._dead: Optional[str] = None
        self._calls = PendingCalls(1)
        self.steps_done = 0
        self._endpoint = _QueueEndpoint(self)
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(cfg, ready), name="rollout-engine", daemon=True)
        self._thread.start()
        self.core: EngineCore = ready.result()  # NOTE: the engine is built on its thread (see the module doc)
        self.kv_capacity = self.core.kv_capacity
        self.context_length = self.core.context_length

    def _run(self, cfg: EngineConfig, ready: Future) -> None:
        try:
            core = EngineCore(cfg)
        except BaseException as exc:  # noqa: BLE001 (raised in the caller by ready.result())
            ready.set_exception(exc)
            return
        ready.set_result(core)
        loop = EngineLoop(core, self._endpoint)
        try:
            loop.run()
        except BaseException as exc:  # noqa: BLE001
            logging.getLogger(__name__).exception("engine thread failed")
            self._die(f"engine thread failed: {exc!r}")
            return
        finally:
            core.close()
        self._die("engine is shut down")

    def _absorb(self, msg: StepOut) -> None:
        self.steps_done = msg.steps
        if msg.updates:
            self._on_updates(msg.updates)
        for reply in msg.replies:
            self._calls.resolve(reply)

    def _die(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        self._calls.fail_all(self._dead)
        self._on_dead(self._dead)

    @property
    def dead_reason(self) -> Optional[str]:
        return self._dead

    def pids(self) -> list[int]:
        return []

    def _check(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def add(self, groups: list[list[ReqSpec]]) -> None:
        self._check()
        self._endpoint.inbox.put(AddReqs([spec for specs in groups for spec in specs]))

    def abort(self, uids: list[int], message: str = "aborted by request") -> None:
        if self._dead is None and uids:
            self._endpoint.inbox.put(AbortReqs(list(uids), message))

    def call(self, method: str, *args: Any) -> list[Any]:
        self._check()
        call_id, futures = self._calls.open()
        try:
            self._endpoint.inbox.put(Call(call_id, method, list(args)))
            return self._calls.wait(futures, self._check)
        finally:
            self._calls.close(call_id)

    def debug(self, fn: Callable[[EngineCore], Any]) -> Any:
        """fn(core) on the engine thread between steps (tests and debugging only)."""
        self._check()
        fut: Future = Future()

        def run() -> None:
            try:
                self.core.drain()   # NOTE: the overlap schedule's running step is processed first
                fut.set_result(fn(self.core))
            except BaseException as exc:  # noqa: BLE001
                fut.set_exception(exc)

        self._endpoint.inbox.put(run)
        return PendingCalls.wait([fut], self._check)[0]

    def close(self) -> None:
        if self._thread.is_alive():
            self._endpoint.inbox.put(Shutdown())
            self._thread.join(timeout=30)
