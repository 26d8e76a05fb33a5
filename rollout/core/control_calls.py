"""ControlCalls: the EngineCore methods that answer the front end's control calls, between steps.

Pause and resume, admission holds and the weight updates they guard (from the front end's
tensors, or received from a trainer's weight-update group), memory release for a colocated
trainer, the weights' version label, and the stats, load and runner reports. Each returns
msgpack-able data. EngineCore (engine_core.py) is this class plus the request path; the state
used here (paused_mode, _admission_holds, _weight_receiver, _memory_saver) is set up by its
constructor, and the engine loop (engine_proc.py: CALLS) names the methods a Call may run.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from rollout.ipc.control_values import PAUSE_MODES
from rollout.ipc.tensor_wire import tensors_from_wire


class ControlCalls:
    PAUSE_MODES = PAUSE_MODES

    def pause(self, mode: str) -> int:
        """Stops scheduling until resume(). abort: finish every request as aborted; retract: move
        running requests back to the queue (KV freed, tokens kept); in_place: keep everything.
        Requests added while paused wait in the queue. Returns the requests aborted/retracted/held."""
        if mode not in self.PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(self.PAUSE_MODES)}, got {mode!r}")
        if mode == "abort":
            count = self.abort_all()
        elif mode == "retract":
            count = self._retract_running()
        else:
            count = len(self.scheduler.running)
        self.paused_mode = mode
        return count

    def resume(self) -> bool:
        was_paused = self.paused_mode is not None
        self.paused_mode = None
        return was_paused

    def _retract_running(self) -> int:
        # newest first: each goes to the queue's front, so the oldest ends up first again
        running = sorted(self.scheduler.running, key=lambda r: r.admit_seq, reverse=True)
        for req in running:
            self.scheduler.retract(req)
        return len(running)

    def hold_admission(self) -> bool:
        """Requests that arrive from now on are not admitted until release_admission(); those
        already here (running or waiting) run to the end, on the current weights (as SGLang's
        weight updates wait for the requests in flight)."""
        if self._admission_holds == 0:
            self.scheduler.hold_admission()
        self._admission_holds += 1
        return True

    def release_admission(self) -> bool:
        assert self._admission_holds > 0
        self._admission_holds -= 1
        if self._admission_holds == 0:
            self.scheduler.release_admission()
        return True

    def try_swap_weights(self, staged: list[list[Any]], weight_version: Optional[str]) -> Optional[int]:
        """Copies validated, staged HF-named tensors (rollout/ipc/tensor_wire.py) into the model
        once the requests that arrived before hold_admission() are done.

        Returns the tensor count, or None while such requests still run or wait (call again after
        a step). Paused in_place, the running requests are retracted first: their KV came from the
        old weights; their tokens, logprobs and (saved) routing so far are kept.
        """
        from rollout.models.loader import load_state_dict_from_tensors  # noqa: PLC0415

        if "weights" in self.released_memory():
            raise ValueError("the weights are released (release_memory_occupation): resume them first")
        if self.paused_mode is not None and self.scheduler.running:
            self._retract_running()
        if self.scheduler.running or (self.paused_mode is None and self.scheduler.has_admissible()):
            return None
        tensors = tensors_from_wire(staged)
        count = load_state_dict_from_tensors(self.model, tensors)
        if self._weight_receiver is not None:
            self._weight_receiver.rewritten(self.model, tensors)
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
    # NOTE: the three group calls are collective (every DP rank's process is a member of the
    # group): under DP the loop runs them on all ranks in the same iteration (COLLECTIVE)
    @property
    def weight_receiver(self) -> Any:
        from rollout.core.weight_receiver import WeightReceiver  # noqa: PLC0415

        if self._weight_receiver is None:
            self._weight_receiver = WeightReceiver(device=self.device, dp_rank=self.dp_rank,
                                                   dp_size=self.cfg.dp_size,
                                                   bucket_bytes=self.cfg.weight_update_bucket_bytes)
        return self._weight_receiver

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout_s: float) -> dict:
        return self.weight_receiver.init_group(master_address, master_port, rank_offset, world_size,
                                               group_name, backend, timeout_s)

    def destroy_weights_update_group(self, group_name: Optional[str]) -> bool:
        return self.weight_receiver.destroy_group(group_name)

    def update_weights_from_distributed(self, names: list, dtypes: list, shapes: list, load_format: Optional[str],
                                        weight_version: Optional[str]) -> Optional[int]:
        """Receives a distributed update straight into the parameters once the requests that arrived
        before hold_admission() are done (None until then, on every DP rank alike: the ranks agree).
        Returns the tensor count; raises ValueError with the reason when the update is refused or
        fails (rollout/core/weight_receiver.py says what is left then)."""
        if self.paused_mode is not None and self.scheduler.running:
            self._retract_running()
        ready = not (self.scheduler.running or (self.paused_mode is None and self.scheduler.has_admissible()))
        if self.ep_group is not None:
            ready = all(r[0] for r in self.ep_group.exchange([int(ready)]))
        if not ready:
            return None
        refuse = ("the weights are released (release_memory_occupation): resume them first"
                  if "weights" in self.released_memory() else None)
        try:
            count = self.weight_receiver.receive(self.model, names, dtypes, shapes, load_format, refuse=refuse)
        finally:
            self.stats["weight_update_buckets"] = (self.stats.get("weight_update_buckets", 0)
                                                   + self.weight_receiver.last_buckets)
            if self.weights_inconsistent():
                self.abort_all(f"aborted: the weights are half-updated ({self.weights_inconsistent()})")
            self._flush_for_new_weights()
        self._updated(weight_version)
        return count

    def read_weight(self, hf_name: str, truncate_size: int) -> Optional[list]:
        from rollout.models.weight_reader import read_hf_weight  # noqa: PLC0415

        return read_hf_weight(self.model, hf_name, truncate_size)

    def set_weight_version(self, version: str, abort_all_requests: bool = False) -> int:
        """Relabels the weights (SGLang's /update_weight_version): outputs finished from now on
        carry it; returns the requests aborted."""
        aborted = self.abort_all() if abort_all_requests else 0
        self.weight_version = version
        return aborted

    # ---- memory release (rollout/core/memory_saver.py) ------------------------------------------
    def release_memory(self, tags: list[str]) -> list[str]:
        from rollout.core.memory_saver import MemorySaver  # noqa: PLC0415

        if self._memory_saver is None:
            self._memory_saver = MemorySaver(self)
        return self._memory_saver.release(tuple(tags))

    def resume_memory(self, tags: list[str]) -> list[str]:
        return self._memory_saver.resume(tuple(tags)) if self._memory_saver is not None else []

    # ---- reports -------------------------------------------------------------------------------
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
        sched = self.scheduler
        return dict(self.stats, num_retractions=sched.num_retractions, kv_used=self.kv_pool.used(),
                    kv_total=self.kv_pool.num_slots, kv_evictable=self.cache.evictable_size(),
                    running=len(sched.running), waiting=len(sched.waiting),
                    prefill_new_seqs=sched.num_admitted, prefill_new_tokens=sched.num_prefill_tokens,
                    prefill_cached_tokens=sched.num_cached_prefill_tokens, **self.outputs.latency.report(),
                    spec_accept_length=self.outputs.accepted.report(),
                    capture_buffer_rows=self.capturer.buffer.rows if self.capturer is not None else 0,
                    capture_buffer_bytes=self.capturer.buffer.nbytes if self.capturer is not None else 0,
                    capture_store_bytes=self.capturer.store.nbytes if self.capturer is not None else 0,
                    cpu_affinity=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                    **(self.cpu_threads.report() if self.cpu_threads is not None
                       else {"cpu_threads": torch.get_num_threads()}))

    def recent_layouts(self) -> list[list]:
        """[runner, token_counts, padded_extent] of each of the latest forwards' GatherLayouts
        (oldest first), for tests and debugging."""
        return [[lay.runner, list(lay.token_counts), lay.padded_extent] for lay in self.runner.recent_layouts]

    def runner_report(self) -> dict:
        """What the static-shape runners captured (tests and debugging)."""
        return self.runner.report()

    def close(self) -> None:
        """Stops the overlap schedule's forward thread, removes a released-weights file, if any, and
        ends a weight-update group."""
        if self.worker is not None:
            self.drain(quiet=True)
            self.worker.close()
        if self._memory_saver is not None:
            self._memory_saver.discard()
        if self._weight_receiver is not None:
            self._weight_receiver.shutdown()
