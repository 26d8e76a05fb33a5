"""EngineControl: what an EngineCore does between steps for the engine loop's control commands.

Pause and resume, admission holds and the weight swap they guard, memory release for a colocated
trainer, the weights' version label, and the stats and load reports. EngineCore (engine_core.py)
inherits it; the state it keeps has class-level defaults, so EngineCore's constructor sets none.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from rollout.ipc.control_values import PAUSE_MODES


class EngineControl:
    # NOTE: EngineCore's (engine_core.py), used here, as is its abort_all()
    scheduler: Any
    cache: Any
    kv_pool: Any
    capturer: Any
    runner: Any
    model: torch.nn.Module
    stats: dict
    weight_version: Optional[str]
    _expert_report: dict
    cpu_threads: Any   # Optional[CpuThreads]

    PAUSE_MODES = PAUSE_MODES
    paused_mode: Optional[str] = None      # None (running) | "abort" | "retract" | "in_place"
    _admission_holds: int = 0              # > 0 while weight updates wait for earlier requests

    def _may_step(self) -> bool:
        """Whether the engine thread should step: never while paused; while a weight update holds
        admission, only for the requests that arrived before it (an idle queue never spins)."""
        if self.paused_mode is not None or self.released_memory or self.weights_inconsistent:
            return False
        return not self._admission_holds or self.scheduler.has_admissible()

    def pause(self, mode: str) -> int:
        """Stops scheduling until resume(). abort: finish every request as aborted; retract: move
        running requests back to the queue (KV freed, tokens kept); in_place: keep everything.
        Requests added while paused wait in the queue. Returns the requests aborted/retracted/held."""
        if mode not in self.PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(self.PAUSE_MODES)}, got {mode!r}")
        if mode == "abort":
            count = self.abort_all()
        elif mode == "retract":
            count = self.retract_running()
        else:
            count = len(self.scheduler.running)
        self.paused_mode = mode
        return count

    def resume(self) -> bool:
        was_paused = self.paused_mode is not None
        self.paused_mode = None
        return was_paused

    def retract_running(self) -> int:
        # newest first: each goes to the queue's front, so the oldest ends up first again
        running = sorted(self.scheduler.running, key=lambda r: r.admit_seq, reverse=True)
        for req in running:
            self.scheduler.retract(req)
        return len(running)

    def hold_admission(self) -> None:
        """Requests that arrive from now on are not admitted until release_admission(); those
        already here (running or waiting) run to the end, on the current weights (as SGLang's
        weight updates wait for the requests in flight)."""
        if self._admission_holds == 0:
            self.scheduler.hold_admission()
        self._admission_holds += 1

    def release_admission(self) -> None:
        assert self._admission_holds > 0
        self._admission_holds -= 1
        if self._admission_holds == 0:
            self.scheduler.release_admission()

    def try_swap_weights(self, staged: dict[str, torch.Tensor], weight_version: Optional[str]) -> Optional[int]:
        """Copies validated, staged HF-named tensors into the model once the requests that arrived
        before hold_admission() are done.

        Returns the tensor count, or None while such requests still run or wait (call again after
        a step). Paused in_place, the running requests are retracted first: their KV came from the
        old weights; their tokens, logprobs and (saved) routing so far are kept.
        """
        from rollout.models.loader import load_state_dict_from_tensors  # noqa: PLC0415

        if "weights" in self.released_memory:
            raise ValueError("the weights are released (release_memory_occupation): resume them first")
        if self.paused_mode is not None and self.scheduler.running:
            self.retract_running()
        if self.scheduler.running or (self.paused_mode is None and self.scheduler.has_admissible()):
            return None
        count = load_state_dict_from_tensors(self.model, staged)
        if self._weight_receiver is not None:
            self._weight_receiver.rewritten(self.model, staged)
        self._flush_for_new_weights()
        self._updated(weight_version)
        return count

    def _flush_for_new_weights(self) -> None:
        flushed = self.cache.flush()
        assert flushed, "prefix cache still locked with no running request"

    def _updated(self, weight_version: Optional[str]) -> None:
        if weight_version is not None:
            self.weight_version = weight_version
        self.stats["weight_updates"] = self.stats.get("weight_updates", 0) + 1

    # ---- the weight-update group (rollout/core/weight_receiver.py) -------------------------------
    cfg: Any
    dp_rank: int
    device: torch.device
    ep_group: Any
    _weight_receiver: Any = None

    @property
    def weight_receiver(self) -> Any:
        from rollout.core.weight_receiver import WeightReceiver  # noqa: PLC0415

        if self._weight_receiver is None:
            self._weight_receiver = WeightReceiver(device=self.device, dp_rank=self.dp_rank,
                                                   dp_size=self.cfg.dp_size,
                                                   bucket_bytes=self.cfg.weight_update_bucket_bytes)
        return self._weight_receiver

    @property
    def weights_inconsistent(self) -> str:
        """Why the weights are half-updated (a failed distributed update), or "" when they are not.
        Nothing is scheduled while they are."""
        r = self._weight_receiver
        return (r.inconsistent_reason or "a failed update") if r is not None and r.inconsistent else ""

    def try_receive_weights(self, names: list, dtypes: list, shapes: list, load_format: Optional[str],
                            weight_version: Optional[str]) -> Optional[int]:
        """Receives a distributed update straight into the parameters once the requests that arrived
        before hold_admission() are done (None until then, on every DP rank alike: the ranks agree).
        Returns the tensor count; raises ValueError with the reason when the update is refused or
        fails (rollout/core/weight_receiver.py says what is left then)."""
        if self.paused_mode is not None and self.scheduler.running:
            self.retract_running()
        ready = not (self.scheduler.running or (self.paused_mode is None and self.scheduler.has_admissible()))
        if self.ep_group is not None:
            ready = all(r[0] for r in self.ep_group.exchange([int(ready)]))
        if not ready:
            return None
        refuse = ("the weights are released (release_memory_occupation): resume them first"
                  if "weights" in self.released_memory else None)
        try:
            count = self.weight_receiver.receive(self.model, names, dtypes, shapes, load_format, refuse=refuse)
        finally:
            self.stats["weight_update_buckets"] = (self.stats.get("weight_update_buckets", 0)
                                                   + self.weight_receiver.last_buckets)
            if self.weights_inconsistent:
                self.abort_all(f"aborted: the weights are half-updated ({self.weights_inconsistent})")
            self._flush_for_new_weights()
        self._updated(weight_version)
        return count

    _memory_saver: Any = None

    @property
    def released_memory(self) -> tuple[str, ...]:
        """The memory tags now released ("weights", "kv_cache"); nothing steps while any is."""
        return self._memory_saver.released if self._memory_saver is not None else ()

    def release_memory(self, tags: tuple[str, ...]) -> list[str]:
        from rollout.core.memory_saver import MemorySaver  # noqa: PLC0415

        if self._memory_saver is None:
            self._memory_saver = MemorySaver(self)
        return self._memory_saver.release(tags)

    def resume_memory(self, tags: tuple[str, ...]) -> list[str]:
        return self._memory_saver.resume(tags) if self._memory_saver is not None else []

    def set_weight_version(self, version: str) -> None:
        """Relabels the weights (SGLang's /update_weight_version); nothing else changes."""
        self.weight_version = version

    def load_report(self) -> list[dict]:
        """Running/waiting requests and KV use per DP rank (one rank in this process)."""
        used, total = self.kv_pool.used(), self.kv_pool.num_slots
        return [{"dp_rank": 0, "num_running_reqs": len(self.scheduler.running),
                 "num_waiting_reqs": len(self.scheduler.waiting), "num_used_tokens": used,
                 "num_waiting_tokens": sum(len(r.prompt_ids) + len(r.output_ids) for r in self.scheduler.waiting),
                 "update_waits": int(self._admission_holds > 0 and self.scheduler.has_admissible()),
                 "num_cached_tokens": self.cache.total_size(), "max_total_num_tokens": total,
                 "token_usage": used / total if total else 0.0, **self._expert_report}]

    def stats_report(self) -> dict:
        return dict(self.stats, num_retractions=self.scheduler.num_retractions, kv_used=self.kv_pool.used(),
                    kv_total=self.kv_pool.num_slots, running=len(self.scheduler.running),
                    waiting=len(self.scheduler.waiting),
                    capture_buffer_bytes=self.capturer.buffer.nbytes if self.capturer is not None else 0,
                    capture_store_bytes=self.capturer.store.nbytes if self.capturer is not None else 0,
                    cpu_affinity=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                    **(self.cpu_threads.report() if self.cpu_threads is not None
                       else {"cpu_threads": torch.get_num_threads()}))

    def recent_layouts(self) -> list:
        """The GatherLayouts of the latest forwards (oldest first), for tests and debugging."""
        return list(self.runner.recent_layouts)

    def close(self) -> None:
        """Removes a released-weights file, if any ."""
        if self._memory_saver is not None:
            self._memory_saver.discard()
        if self._weight_receiver is not None:
            self._weight_receiver.shutdown()
