"""EngineLoop: drains the inbox between steps, steps the EngineCore, sends one StepOut per step.

The loop never waits on the front end: it blocks only while it has nothing to do. Under DP
attention every rank runs this loop and the ranks agree each iteration (one small all-reduce of
[has work, stop]) whether to step, so collectives inside the forward line up; an idle rank runs
an empty forward.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch

from rollout.core.engine_core import EngineCore
from rollout.ipc.tensor_wire import tensors_from_wire
from rollout.ipc.messages import AbortReqs, AddReqs, Call, FromEngine, Reply, ReqSpec, Shutdown, StepOut, ToEngine
from rollout.core.request import Req, cache_namespace
from rollout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineEndpoint(Protocol):
    def recv(self, timeout: float) -> list[ToEngine]:
        """Every message waiting; blocks up to timeout seconds for the first one."""

    def send(self, msg: FromEngine) -> None:
        ...


def req_from_spec(spec: ReqSpec) -> Req:
    return Req(uid=spec.uid, rid=spec.rid, prompt_ids=np.frombuffer(spec.prompt_ids, dtype=np.int32).tolist(),
               params=SamplingParams(**spec.params), seed=spec.seed, return_logprob=spec.return_logprob,
               top_logprobs_num=spec.top_logprobs_num, return_routed_experts=spec.return_routed_experts,
               routed_experts_start_len=spec.routed_experts_start_len, emit_interval=spec.emit_interval,
               max_total_len=spec.max_total_len, routed_dp_rank=spec.routed_dp_rank, cache_ns=cache_namespace(spec.cache_salt),
               prompt_logprob_start=spec.prompt_logprob_start)


class EngineCommands:
    """The control commands a Call may name; each runs between steps and returns msgpack-able data."""

    def __init__(self, core: EngineCore):
        self.core = core

    def abort_all(self, message: str = "aborted by request") -> int:
        return self.core.abort_all(message)

    def flush_cache(self) -> bool:
        return self.core.flush_cache()

    def check_integrity(self) -> bool:
        self.core.check_integrity()
        return True

    def stats_report(self) -> dict:
        return self.core.stats_report()

    def load_report(self) -> list[dict]:
        return self.core.load_report()

    def recent_layouts(self) -> list[list]:
        return [[lay.runner, list(lay.token_counts), lay.padded_extent] for lay in self.core.recent_layouts()]

    def runner_report(self) -> dict:
        """What the static-shape runners captured (tests and debugging)."""
        return self.core.runner.report()

    def pause(self, mode: str) -> int:
        return self.core.pause(mode)

    def resume(self) -> bool:
        return self.core.resume()

    def retract_running(self) -> int:
        return self.core.retract_running()

    def hold_admission(self) -> bool:
        self.core.hold_admission()
        return True

    def release_admission(self) -> bool:
        self.core.release_admission()
        return True

    def try_swap_weights(self, staged: list[list[Any]], weight_version: Optional[str]) -> Optional[int]:
        return self.core.try_swap_weights(tensors_from_wire(staged), weight_version)

    def weight_version(self) -> str:
        return self.core.weight_version

    # NOTE: the three weight-group commands are collective (every DP rank's process is a member of
    # the group): under DP the loop runs them on all ranks in the same iteration (COLLECTIVE)
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout_s: float) -> dict:
        return self.core.weight_receiver.init_group(master_address, master_port, rank_offset, world_size,
                                                    group_name, backend, timeout_s)

    def update_weights_from_distributed(self, names: list, dtypes: list, shapes: list, load_format: Optional[str],
                                        weight_version: Optional[str]) -> Optional[int]:
        return self.core.try_receive_weights(names, dtypes, shapes, load_format, weight_version)

    def destroy_weights_update_group(self, group_name: Optional[str]) -> bool:
        return self.core.weight_receiver.destroy_group(group_name)

    def weights_inconsistent(self) -> str:
        return self.core.weights_inconsistent

    def read_weight(self, hf_name: str, truncate_size: int) -> Optional[list]:
        from rollout.models.weight_reader import read_hf_weight  # noqa: PLC0415

        return read_hf_weight(self.core.model, hf_name, truncate_size)

    def set_weight_version(self, version: str, abort_all_requests: bool = False) -> int:
        """Relabels the weights (outputs finished from now on carry it); returns the requests aborted."""
        aborted = self.core.abort_all() if abort_all_requests else 0
        self.core.set_weight_version(version)
        return aborted

    def release_memory(self, tags: list[str]) -> list[str]:
        return self.core.release_memory(tuple(tags))

    def resume_memory(self, tags: list[str]) -> list[str]:
        return self.core.resume_memory(tuple(tags))

    def released_memory(self) -> list[str]:
        return list(self.core.released_memory)


COMMANDS = frozenset(name for name in vars(EngineCommands) if not name.startswith("_"))
COLLECTIVE = frozenset({"init_weights_update_group", "update_weights_from_distributed",
                        "destroy_weights_update_group"})


class StepSync:
    """DP: every rank learns each iteration whether any rank has work or wants to stop, and how
    many collective commands every rank has received (those run now, on all ranks together)."""

    def __init__(self, device: torch.device):
        self._flags = torch.zeros(3, dtype=torch.int32, device=device)

    def agree(self, has_work: bool, stop: bool, pending: int = 0) -> tuple[bool, bool, int]:
        import torch.distributed as dist  # noqa: PLC0415

        # NOTE: MAX of -pending is -(the fewest pending on any rank)
        self._flags[0], self._flags[1], self._flags[2] = int(has_work), int(stop), -pending
        dist.all_reduce(self._flags, op=dist.ReduceOp.MAX)
        work, stop_all, ready = self._flags.tolist()
        return bool(work), bool(stop_all), -ready


class EngineLoop:
    IDLE_WAIT_S = 0.5         # single rank: how long an idle loop blocks on its inbox at a time
    DP_IDLE_WAIT_S = 0.005    # DP: idle ranks meet this often (a new request waits at most this)

    def __init__(self, core: EngineCore, endpoint: EngineEndpoint, *, sync: Optional[StepSync] = None,
                 alive: Callable[[], bool] = lambda: True):
        self.core = core
        self.endpoint = endpoint
        self.sync = sync
        self.alive = alive     # False once the front end is gone (the loop then exits)
        self.commands = EngineCommands(core)
        self.stopping = False
        self.steps = 0
        self.pending: deque[Call] = deque()   # DP: collective commands not yet received by every rank
        # the CPU threads that change by step, if any (rollout/core/cpu_threads.py), and whether the
        # previous message carried stream deltas (the front end works on them meanwhile)
        self.threads = core.cpu_threads if core.cpu_threads is not None and core.cpu_threads.switches else None
        self.streamed = False

    def _handle(self, msg: ToEngine, replies: list[Reply]) -> None:
        if isinstance(msg, AddReqs):
            for spec in msg.reqs:
                self.core.add_request(req_from_spec(spec))
                if self.core.weights_inconsistent:
                    # NOTE: sent before the front end learnt of the failed update: never run
                    self.core.abort(spec.uid, f"aborted: the weights are half-updated ({self.core.weights_inconsistent})")
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
        if msg.method not in COMMANDS:
            return Reply(call_id=msg.call_id, error=f"unknown engine command {msg.method!r}", error_type="ValueError")
        try:
            return Reply(call_id=msg.call_id, result=getattr(self.commands, msg.method)(*msg.args))
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
                    self.threads.use(front_end_busy=self.streamed)
                core.step()
                self.steps += 1
            self._send(replies, stepped=work)
            if sync is None and not work and not self.alive():
                return

    def _send(self, replies: list[Reply], stepped: bool = False) -> None:
        """One message per step that ran (its step count is how the front end knows the engine
        lives), or when a call needs its reply."""
        updates = self.core.take_updates()
        if self.threads is not None:
            self.streamed = any(not u.finished for u in updates)
        if updates or replies or stepped:
            self.endpoint.send(StepOut(updates=updates, replies=replies, steps=self.steps))
