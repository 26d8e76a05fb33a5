"""The engine process (one per DP rank): its entry point, engine_main, and its loop, EngineLoop.

engine_main builds the EngineCore (the model is loaded in this process), says Ready, then runs
the EngineLoop until Shutdown, the front end's death, or an error. An error is reported as Fatal
(with its traceback) before the process exits non-zero; under DP, a rank whose peer died first
aborts its own requests so their partial outputs reach the front end.

EngineLoop drains the inbox between steps, steps the EngineCore, sends one StepOut per step. It
never waits on the front end: it blocks only while it has nothing to do. A Call runs the
EngineCore method it names (one of CALLS) between steps. Under DP attention every rank runs this
loop and the ranks agree each iteration (one small all-reduce of [has work, stop]) whether to
step, so collectives inside the forward line up; an idle rank runs an empty forward.
"""
from __future__ import annotations

import signal

if __name__ == "__main__":
    # NOTE: before the imports below (torch: seconds). A terminal's Ctrl-C and SLURM's or a supervisor's
    # SIGTERM reach the whole process group; the engine ends when its front end tells it to (after
    # aborting with partial outputs) or exits, so a Ctrl-C while it loads prints no traceback here.
    # The front end starts it with SIGINT blocked (process_client.py): ignored now, it is unblocked.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

import json
import logging
import os
import sys
import time
import traceback
from collections import deque
from datetime import timedelta
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch

from rollout.config import EngineConfig
from rollout.core.cpu_threads import CpuThreads
from rollout.core.engine_core import EngineCore
from rollout.core.request import Req, cache_namespace
from rollout.cpu_affinity import pin_process
from rollout.host_malloc import bound_onednn_caches, trim_heap
from rollout.ipc.control_values import PEER_FAILED   # NOTE: the front end replaces it with the dead rank's name and exit code
from rollout.ipc.messages import (AbortReqs, AddReqs, Call, Fatal, FromEngine, Ready, Reply, ReqSpec, Shutdown,
                                  StepOut, ToEngine)
from rollout.ipc.node_address import NodeAddress
from rollout.ipc.transport import EngineSockets, pid_alive
from rollout.sampling_params import SamplingParams
from rollout.value_range import check_host_port

COLLECTIVE_TIMEOUT = timedelta(seconds=600)
logger = logging.getLogger(__name__)

# The EngineCore methods (engine_core.py, control_calls.py) a Call may name; each returns msgpack-able data.
CALLS = frozenset({
    "abort_all", "flush_cache", "check_integrity", "stats_report", "load_report", "recent_layouts",
    "runner_report", "pause", "resume", "hold_admission", "release_admission", "try_swap_weights",
    "init_weights_update_group", "update_weights_from_distributed", "destroy_weights_update_group",
    "weights_inconsistent", "read_weight", "set_weight_version", "release_memory", "resume_memory",
    "released_memory"})
# NOTE: collective: every DP rank's process is a member of the weight-update group, so under DP
# the loop runs these on all ranks in the same iteration
COLLECTIVE = frozenset({"init_weights_update_group", "update_weights_from_distributed",
                        "destroy_weights_update_group"})


class EngineEndpoint(Protocol):
    def recv(self, timeout: float) -> list[ToEngine]:
        """Every message waiting; blocks up to timeout seconds for the first one."""

    def send(self, msg: FromEngine) -> None:
        ...


def req_from_spec(spec: ReqSpec) -> Req:
    """The engine's Req of a ReqSpec the front end built (its sampling params already checked there)."""
    return Req(uid=spec.uid, rid=spec.rid, prompt_ids=np.frombuffer(spec.prompt_ids, dtype=np.int32).tolist(),
               params=SamplingParams.trusted(spec.params), seed=spec.seed, return_logprob=spec.return_logprob,
               top_logprobs_num=spec.top_logprobs_num, return_routed_experts=spec.return_routed_experts,
               routed_experts_start_len=spec.routed_experts_start_len, emit_interval=spec.emit_interval,
               max_total_len=spec.max_total_len, routed_dp_rank=spec.routed_dp_rank,
               cache_ns=cache_namespace(spec.cache_salt), prompt_logprob_start=spec.prompt_logprob_start,
               arrival_time=spec.arrival_time)


class StepSync:
    """DP: every rank learns each iteration whether any rank has work or wants to stop, and how
    many collective commands every rank has received (those run now, on all ranks together).
    Host values over the EP group's gloo meta_group: no device sync."""

    def __init__(self, group: Any = None):
        self._flags = torch.zeros(3, dtype=torch.int32)
        self.group = group

    def agree(self, has_work: bool, stop: bool, pending: int = 0) -> tuple[bool, bool, int]:
        import torch.distributed as dist  # noqa: PLC0415

        # NOTE: MAX of -pending is -(the fewest pending on any rank)
        self._flags[0], self._flags[1], self._flags[2] = int(has_work), int(stop), -pending
        dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self.group)
        work, stop_all, ready = self._flags.tolist()
        return bool(work), bool(stop_all), -ready


class EngineLoop:
    IDLE_WAIT_S = 0.5         # single rank: how long an idle loop blocks on its inbox at a time
    DP_IDLE_WAIT_S = 0.005    # DP: idle ranks meet this often (a new request waits at most this)
    IDLE_TRIM_INTERVAL_S = 10.0   # CPU engine: the heap is trimmed when it falls idle, at most this often

    def __init__(self, core: EngineCore, endpoint: EngineEndpoint, *, sync: Optional[StepSync] = None,
                 alive: Callable[[], bool] = lambda: True):
        self.core = core
        self.endpoint = endpoint
        self.sync = sync
        self.alive = alive     # False once the front end is gone (the loop then exits)
        self.stopping = False
        self.steps = 0
        self.pending: deque[Call] = deque()   # DP: collective commands not yet received by every rank
        # the CPU threads that change by step, if any (rollout/core/cpu_threads.py), and whether the
        # previous message carried stream deltas (the front end works on them meanwhile)
        self.threads = core.cpu_threads if core.cpu_threads is not None and core.cpu_threads.switches else None
        self.streamed = False
        # NOTE: a CPU engine keeps freed heap pages (rollout/host_malloc.py raises glibc's trim
        # threshold), and the holes that step temporaries and oneDNN's shape-keyed kernel caches
        # leave between live blocks are never given back on their own: RSS grew ~0.4 MB a step
        # for hundreds of GRPO steps. malloc_trim when the engine falls idle (10-25 ms) returns them.
        self.trim_idle = core.device.type == "cpu"
        self._trimmed_at = 0                   # self.steps at the last trim
        self._next_trim = 0.0                  # time.monotonic() before which no trim runs

    def _handle(self, msg: ToEngine, replies: list[Reply]) -> None:
        if isinstance(msg, AddReqs):
            for spec in msg.reqs:
                self.core.add_request(req_from_spec(spec))
                why = self.core.weights_inconsistent()
                if why:
                    # NOTE: sent before the front end learnt of the failed update: never run
                    self.core.abort(spec.uid, f"aborted: the weights are half-updated ({why})")
        elif isinstance(msg, AbortReqs):
            for uid in msg.uids:
                self.core.abort(uid, msg.message)
        elif isinstance(msg, Call):
            if self.sync is not None and msg.method in COLLECTIVE:
                self.pending.append(msg)
            else:
                replies.append(self._call(msg))
        elif isinstance(msg, Shutdown):
            self.stopping = True
        else:
            raise AssertionError(f"unknown message {type(msg).__name__}")

    def _call(self, msg: Call) -> Reply:
        if msg.method not in CALLS:
            return Reply(call_id=msg.call_id, error=f"unknown engine command {msg.method!r}", error_type="ValueError")
        self.core.drain()   # NOTE: the overlap schedule: a call sees the state a sequential loop leaves
        try:
            return Reply(call_id=msg.call_id, result=self.core.on_forward_thread(getattr(self.core, msg.method),
                                                                                 *msg.args))
        except Exception as exc:  # noqa: BLE001 (a command's error goes back to its caller)
            if not isinstance(exc, ValueError):
                logger.exception("engine command %s failed", msg.method)
            return Reply(call_id=msg.call_id, error=str(exc), error_type=type(exc).__name__)

    def run(self) -> None:
        core, sync = self.core, self.sync
        while True:
            work = core.has_work()
            if sync is None:
                wait = 0.0 if work else self.IDLE_WAIT_S
            else:
                wait = 0.0 if work else self.DP_IDLE_WAIT_S
            replies: list[Reply] = []
            for msg in self.endpoint.recv(wait):
                self._handle(msg, replies)
            work = core.has_work()
            if sync is not None:
                # NOTE: an orphaned rank (front end gone) stops all ranks together, at the next meeting
                orphaned = not work and not self.alive()
                work, stop, ready = sync.agree(work, self.stopping or orphaned, len(self.pending))
                self.stopping = self.stopping or stop
                if ready and not self.stopping:
                    # NOTE: every rank got them in the same order (the front end sends them one at a time)
                    replies += [self._call(self.pending.popleft()) for _ in range(ready)]
            if self.stopping:
                self._send(replies)
                return
            if work:
                if self.threads is not None:
                    core.use_threads(self.threads.use(front_end_busy=self.streamed))
                core.step()
                self.steps += 1
            self._send(replies, stepped=work)
            if not work:
                if sync is None and not self.alive():
                    return
                self._trim_when_idle()

    def _trim_when_idle(self) -> None:
        """Gives the heap's free pages back once per idle spell that follows steps (rate-limited)."""
        if not self.trim_idle or self.steps == self._trimmed_at or time.monotonic() < self._next_trim:
            return
        trim_heap()
        self._trimmed_at = self.steps
        self._next_trim = time.monotonic() + self.IDLE_TRIM_INTERVAL_S

    def _send(self, replies: list[Reply], stepped: bool = False) -> None:
        """One message per step that ran (its step count is how the front end knows the engine
        lives), or when a call needs its reply."""
        updates = self.core.take_updates()
        if self.threads is not None:
            self.streamed = any(not u.finished for u in updates)
        if updates or replies or stepped:
            self.endpoint.send(StepOut(updates=updates, replies=replies, steps=self.steps))


def _join_dp_group(cfg: EngineConfig, rank: int, rendezvous: str) -> tuple[EngineConfig, Any]:
    """Joins the DP group (every rank of every node) at the rendezvous store "host:port" as global
    rank `rank`; on CUDA this rank runs on its node-local GPU."""
    import torch.distributed as dist  # noqa: PLC0415

    from rollout.models.moe.ep_group import EPGroup  # noqa: PLC0415

    host, port = check_host_port("rendezvous", rendezvous)
    # NOTE: gloo (the CPU engines' group and every engine's host-value group) would otherwise bind
    # the address the hostname resolves to: it takes the interface this node reaches the rendezvous
    # host on (`lo` on one node), unless GLOO_SOCKET_IFNAME is set. Set here, in the engine process only.
    NodeAddress.toward(host).set_socket_interfaces()
    cuda = cfg.device.startswith("cuda")
    if cuda:
        device = torch.device("cuda", cfg.local_rank(rank))
        torch.cuda.set_device(device)
        cfg = cfg.replace(device=str(device))
    else:
        device = torch.device("cpu")
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=cfg.dist_timeout))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=cfg.dp_size,
                            timeout=COLLECTIVE_TIMEOUT)
    # NOTE: host values (the step's shapes, StepSync's flags) over a gloo group of their own: no
    # device sync on the step path, and with the overlap schedule they are exchanged on the
    # scheduling thread while the forward thread runs collectives over the main group
    meta = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return cfg, EPGroup(rank=rank, size=cfg.dp_size, device=device, meta_group=meta)


def engine_main(config: dict, rank: int, to_engine_addr: str, from_engine_addr: str,
                rendezvous: Optional[str], parent_pid: int, sentinel_fd: Optional[int] = None) -> None:
    """rank: the global DP rank; rendezvous: the DP group's store "host:port" (None: one rank);
    parent_pid: the front end's (or, on another node, its launcher's) pid: the loop ends when it is
    gone. sentinel_fd: the write end of the parent's exit pipe, held open (and never written) for
    the life of this process."""
    logging.basicConfig(level=os.environ.get("ROLLOUT_LOG_LEVEL", "WARNING"))
    sockets = EngineSockets(to_engine_addr, from_engine_addr)
    code = 0
    core: Optional[EngineCore] = None
    try:
        cfg = EngineConfig(**config)
        if not cfg.device.startswith("cuda"):
            bound_onednn_caches()   # NOTE: this process only (an in-process engine leaves its caller's alone)
        if cfg.cpu_affinity:
            pin_process(cfg.cpu_affinity_of(rank))
        threads = None if cfg.device.startswith("cuda") else CpuThreads(cfg.resolved_cpu_threads, cfg.cpu_reserve)
        ep_group = sync = None
        if cfg.dp_size > 1:
            cfg, ep_group = _join_dp_group(cfg, rank, rendezvous)
            sync = StepSync(ep_group.meta_group)
        core = EngineCore(cfg, ep_group=ep_group, cpu_threads=threads)
        sockets.send(Ready(info={"kv_capacity": core.kv_capacity, "context_length": core.context_length,
                                 "weight_version": core.weight_version, "pid": os.getpid()}))
        # NOTE: the front end's pid, not os.getppid(): under forkserver the parent is the fork server
        EngineLoop(core, sockets, sync=sync, alive=lambda: pid_alive(parent_pid)).run()
    except BaseException:  # noqa: BLE001 (reported to the front end, then the process exits non-zero)
        code = 1
        text = traceback.format_exc()
        where = "failed to start" if core is None else "failed"
        if core is not None:
            try:
                core.abort_all(PEER_FAILED if cfg.dp_size > 1 else f"engine failed: {text.strip().splitlines()[-1]}")
                sockets.send(StepOut(updates=core.take_updates()))
            except BaseException:  # noqa: BLE001
                pass
        try:
            sockets.send(Fatal(traceback=f"engine rank {rank} {where}:\n{text}"))
        except BaseException:  # noqa: BLE001
            pass
    finally:
        if core is not None:
            core.close()
        try:
            import torch.distributed as dist  # noqa: PLC0415

            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:  # noqa: BLE001
            pass
        sockets.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # NOTE: skip the interpreter's teardown (about a second with torch loaded)
        os._exit(code)


if __name__ == "__main__":
    _cfg, _rank, _to, _from, _store, _parent, _fd = sys.argv[1:8]
    engine_main(json.loads(_cfg), int(_rank), _to, _from, None if _store == "-" else _store, int(_parent), int(_fd))
