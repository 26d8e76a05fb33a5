"""WeightControl: Rollout's weight updates, driven from the front end, done by the engine processes.

Two ways in. `swap_weights` installs tensors the caller already holds (disk and tensor updates).
The distributed way keeps every tensor out of this process: `init_weights_update_group` makes
every engine process (every DP rank) join the trainer's group itself, and
`update_weights_from_distributed` only forwards the metadata; each engine receives the broadcasts
bucket by bucket straight into its parameters (rollout/core/weight_receiver.py). Both wait for the
requests that arrived before the update to finish on the old weights, as SGLang does.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from rollout.frontend.engine_client import WeightsInconsistentError

__all__ = ["WeightControl", "WeightsInconsistentError"]


class WeightControl:
    # NOTE: Rollout's (api.py)
    _call: Callable[..., list]
    _builder: Any
    _client: Any
    paused_mode: Optional[str]
    weight_version: Optional[str]
    loads: Callable[[], list]
    # NOTE: one weight call at a time, so every DP rank gets the collective ones in the same order
    _weights_lock: threading.Lock

    def _when_idle(self, attempt: Callable[[], list], *, abort_all_requests: bool, poll_s: float,
                   prepare: Optional[Callable[[], None]] = None) -> list:
        """attempt() on every rank once the requests that arrived before are done (each rank
        answers None while not); requests arriving meanwhile queue for the new weights. prepare()
        runs once admission is held (and the requests aborted, when asked), before the wait."""
        if abort_all_requests:
            self._call("abort_all")
        self._call("hold_admission")
        try:
            if prepare is not None:
                prepare()
            while True:
                # NOTE: a cheap check first, so the tensors travel to the ranks only once the running
                # requests are done (or paused, when they get retracted)
                if self.paused_mode is not None or not any(ld["update_waits"] for ld in self.loads()):
                    results = attempt()
                    if all(r is not None for r in results):
                        return results
                time.sleep(poll_s)
        finally:
            if self._client.dead_reason is None:
                self._call("release_admission")

    def swap_weights(self, staged: dict | Callable[[], dict], *, weight_version: Optional[str] = None,
                     abort_all_requests: bool = False, poll_s: float = 0.005) -> int:
        """Installs already validated and staged HF-named tensors, all at once, between steps.

        With abort_all_requests every request in flight is aborted first (partial outputs).
        Otherwise the swap waits for every request that arrived before it (running or queued) to
        finish on the current weights, as SGLang does; requests that arrive meanwhile queue and run
        on the new weights. Paused, the running requests are retracted instead. The prefix cache is
        flushed and weight_version set (when given). Blocks the calling thread; returns the tensors
        copied. staged may be a function that makes them (reads a checkpoint): it runs after the
        abort, with admission held, as SGLang reads a checkpoint under its update lock.
        """
        from rollout.ipc.tensor_wire import tensors_to_wire  # noqa: PLC0415

        wire: list = []

        def prepare() -> None:
            wire[:] = tensors_to_wire(staged() if callable(staged) else staged)

        with self._weights_lock:
            counts = self._when_idle(lambda: self._call("try_swap_weights", wire, weight_version),
                                     abort_all_requests=abort_all_requests, poll_s=poll_s, prepare=prepare)
            self._refresh_consistency()
        if weight_version is not None:
            self.weight_version = weight_version
        return counts[0]

    # ---- over torch.distributed: every engine process is a member of the group ----------------
    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str, timeout_s: float) -> list[dict]:
        """Every engine process joins; DP rank r as rank rank_offset + r. Returns each one's
        {group_name, rank, world_size, backend}. Blocks until the whole group has joined."""
        with self._weights_lock:
            return self._call("init_weights_update_group", master_address, master_port, rank_offset, world_size,
                              group_name, backend, timeout_s)

    def destroy_weights_update_group(self, group_name: Optional[str] = None) -> bool:
        with self._weights_lock:
            return all(self._call("destroy_weights_update_group", group_name))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                        load_format: Optional[str] = None, weight_version: Optional[str] = None,
                                        abort_all_requests: bool = False, poll_s: float = 0.005) -> int:
        """Each engine process receives the trainer's broadcasts of these tensors (names order;
        load_format "flattened_bucket": one broadcast of their bytes concatenated, as SGLang's
        FlattenedTensorBucket) into its parameters. The metadata must be valid (the caller checks
        types); names/shapes that do not fit the model are refused after the tensors were received
        and dropped. Raises ValueError with the engine's reason on failure; when a failure left the
        weights half-updated, generation raises WeightsInconsistentError until an update rewrites
        them (weights_inconsistent says why)."""
        with self._weights_lock:
            try:
                counts = self._when_idle(
                    lambda: self._call("update_weights_from_distributed", names, dtypes, shapes, load_format,
                                       weight_version),
                    abort_all_requests=abort_all_requests, poll_s=poll_s)
            finally:
                if self._client.dead_reason is None:
                    self._refresh_consistency()
        if weight_version is not None:
            self.weight_version = weight_version
        return counts[0]

    @property
    def weights_inconsistent(self) -> str:
        """Why the weights are half-updated ("" when they are not): generation is refused meanwhile."""
        return self._builder.weights_inconsistent

    def _refresh_consistency(self) -> None:
        reasons = self._call("weights_inconsistent")   # one per DP rank, "" where consistent
        if len(reasons) > 1:
            reasons = [f"DP rank {r}: {why}" for r, why in enumerate(reasons) if why]
        self._builder.weights_inconsistent = "; ".join(why for why in reasons if why)
