"""WeightReceiver: an engine process's member of a trainer's weight-update group.

Every engine process (every DP rank) joins the group itself, as rank rank_offset + its DP rank
(SGLang: rank_offset + tp_rank; world_size is the whole group: the trainer's ranks plus every
engine process of every server). The trainer's rank 0 broadcasts the tensors in `names` order;
this process receives them bucket by bucket (at most `bucket_bytes` each, a tensor larger than
that alone) into views of one buffer the size of the largest bucket
(rollout/core/weight_bucket.py), checks each bucket's finiteness (without temporaries), copies it
into the parameters (the checkpoint-name mapping of rollout/models/loader.py: per-expert tensors
go slice-wise into the fused experts, an expert shard keeps only its own experts) and then
receives the next into the same buffer. The buffer is released after the update (on a GPU with
empty_cache(), on the CPU with a heap trim).
No copy of the whole model is ever staged, in this process or the front end: the peak beyond the
model is the largest bucket (measured: docs/benchmarks.md).

NOTE: a broadcast delivers every byte to every member, so each rank receives every tensor (an
expert shard drops the experts it does not hold after receiving them).

Failure semantics (as SGLang, which also copies in place):
- the metadata (names, shapes, dtypes) is checked against the model before anything is
  received; on a mismatch the tensors are received and dropped (the trainer's broadcasts must
  not hang) and nothing changes;
- a broadcast that fails (the trainer died, the group timed out) or a bucket holding NaN/inf
  after earlier buckets were copied leaves the weights half-updated: the receiver records which
  parameter pieces are inconsistent, the engine refuses to run any request until a later update
  has rewritten all of them, and the front end answers generation with 503.
"""
from __future__ import annotations

import datetime
import logging
import math
from typing import Any, Optional

import torch

from rollout.core.weight_bucket import WeightBucket, buckets, finite
from rollout.host_malloc import trim_heap
from rollout.ipc.control_values import LOAD_FORMATS, WEIGHT_DTYPES as DTYPES
from rollout.models.loader import _experts_of, _pieces, copy_into, plan, resolve, source_view
from rollout.weight_group import init_custom_process_group

logger = logging.getLogger(__name__)


class WeightReceiver:
    def __init__(self, *, device: torch.device, dp_rank: int, dp_size: int, bucket_bytes: int):
        self.device = device
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.bucket_bytes = bucket_bytes
        self.group = None
        self.info: Optional[dict] = None
        # (param name, expert, half) pieces a failed update left half-written; empty = consistent
        self.inconsistent: set[tuple] = set()
        self.inconsistent_reason = ""
        self.last_buckets = 0   # how many buckets the latest receive() took

    # ---- the group -----------------------------------------------------------------------------
    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float) -> dict:
        if self.group is not None:
            raise ValueError(f"weights update group {self.info['group_name']!r} already exists; destroy it first")
        rank = rank_offset + self.dp_rank
        if rank_offset + self.dp_size > world_size:
            raise ValueError(f"rank_offset ({rank_offset}) + this server's engine processes ({self.dp_size}) "
                             f"must be <= world_size ({world_size}): the trainer is rank 0, the server's "
                             f"engine processes take ranks rank_offset .. rank_offset + {self.dp_size - 1}")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"backend 'nccl' needs a CUDA device; this engine runs on {self.device.type} (use gloo)")
        host = f"[{master_address}]" if ":" in master_address else master_address
        try:
            pg = init_custom_process_group(backend, f"tcp://{host}:{master_port}", world_size, rank, group_name,
                                           datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 (rendezvous raises many kinds)
            raise ValueError(f"init_weights_update_group failed: {type(exc).__name__}: {exc}") from None
        self.group = pg
        self.info = {"group_name": group_name, "rank": rank, "world_size": world_size, "backend": backend}
        return dict(self.info)

    def destroy_group(self, group_name: Optional[str]) -> bool:
        if self.group is None:
            raise ValueError("no weights update group exists")
        if group_name is not None and group_name != self.info["group_name"]:
            raise ValueError(f"group_name {group_name!r} does not match the existing group "
                             f"{self.info['group_name']!r}"[:300])
        self._destroy()
        return True

    def _destroy(self) -> None:
        import torch.distributed as dist

        pg, self.group, self.info = self.group, None, None
        try:
            dist.destroy_process_group(pg)
        except Exception:  # noqa: BLE001 (a broken group is gone either way)
            logger.warning("destroying the weights update group failed", exc_info=True)

    # ---- receiving -----------------------------------------------------------------------------
    def receive(self, model: torch.nn.Module, names: list[str], dtypes: list[str], shapes: list[list[int]],
                load_format: Optional[str], refuse: Optional[str] = None) -> int:
        """Receives one update's broadcasts and copies them into model's parameters, bucket by
        bucket; returns the tensors accepted (counted over the model, as the other paths do)."""
        self.last_buckets = 0
        if self.group is None:
            raise ValueError("no weights update group: call /init_weights_update_group first")
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
        torch_dtypes = [DTYPES[d.removeprefix("torch.")] for d in dtypes]
        problem = refuse
        try:
            targets = plan(model, {n: tuple(s) for n, s in zip(names, shapes)}, require_all=False,
                           source="update_weights_from_distributed")
        except ValueError as exc:
            problem, targets = str(exc), {}
        if refuse is not None:
            targets = {}
        elif problem is None and not targets:
            problem = "update_weights_from_distributed holds no tensor for this model (only ignored names)"
        params = dict(model.named_parameters())
        device = self.device if self.info["backend"] == "nccl" else torch.device("cpu")
        pieces = {n: self._pieces_of(model, t) for n, t in targets.items()}
        written: set[tuple] = set()
        nbytes = [math.prod(s) * torch.empty((), dtype=dt).element_size() for s, dt in zip(shapes, torch_dtypes)]
        packed = load_format == "flattened_bucket"
        # NOTE: flattened: one broadcast of the trainer's whole bucket, received as sent (its size is the trainer's)
        groups = [range(len(names))] if packed else list(buckets(nbytes, self.bucket_bytes))
        self.last_buckets = len(groups)
        bucket = WeightBucket(groups, nbytes, device, packed=packed)
        try:
            for idx in groups:
                try:
                    received = self._recv(bucket, idx, torch_dtypes, shapes, packed)
                except Exception as exc:  # noqa: BLE001 (a failed collective leaves the group unusable)
                    self._destroy()
                    reason = f"receiving tensors failed ({type(exc).__name__}: {exc})"
                    raise ValueError(self._fail(reason, written, pieces)) from None
                if problem is None:
                    problem = self._install(model, params, targets, pieces, [names[i] for i in idx], received,
                                            written)
                del received
        finally:
            bucket.release()
            if device.type == "cpu":
                trim_heap()   # NOTE: the heap pages the update's small temporaries grew go back to the OS
        if problem is not None:
            if self.inconsistent and written:
                raise ValueError(problem + "\n(the weights are now half-updated: generation is refused until an "
                                           "update rewrites them)")
            raise ValueError(problem + "\n(the tensors were received and dropped; old weights keep serving)")
        self._rewritten(written)
        return sum(resolve(model, n) is not None for n in names)

    def _install(self, model: torch.nn.Module, params: dict, targets: dict, pieces: dict, names: list[str],
                 received: list[torch.Tensor], written: set) -> Optional[str]:
        """Copies one received bucket into the parameters (all of it, or nothing when a tensor is
        not finite: then the problem, and the weights marked inconsistent if earlier buckets were
        copied)."""
        checked = [(name, value) for name, value in zip(names, received) if name in targets]
        for (name, _), ok in zip(checked, finite([v for _, v in checked])):
            if not ok:
                problem = f"update_weights_from_distributed: tensor {name!r} holds NaN or infinite values"
                if written:
                    self._mark(problem, pieces)
                return problem
        with torch.no_grad():
            for name, value in zip(names, received):
                t = targets.get(name)
                if t is not None:
                    copy_into(model, params, t, source_view(value, t))
                    written |= pieces[name]
        return None

    def _recv(self, bucket: WeightBucket, idx: range, dtypes: list, shapes: list, packed: bool) -> list[torch.Tensor]:
        """One bucket's broadcasts, received into views of the update's buffer."""
        import torch.distributed as dist

        out = bucket.views(idx, dtypes, shapes)
        if packed:
            # SGLang's FlattenedTensorBucket: every tensor's bytes, concatenated in names order
            dist.broadcast(bucket.flat(idx), src=0, group=self.group)
            return out
        works = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in out]
        for w in works:
            w.wait()
        return out

    @staticmethod
    def _pieces_of(model: torch.nn.Module, t: Any) -> set[tuple]:
        experts = _experts_of(model, t.param)
        if t.expert is not None:
            return {(t.param, t.expert, t.half)}
        return {(t.param, e, h) for e, h in _pieces(t.param, experts)}

    def rewritten(self, model: torch.nn.Module, named: dict[str, torch.Tensor]) -> None:
        """A whole update (disk, tensor) was copied into the model: its pieces are consistent again."""
        if self.inconsistent:
            targets = plan(model, {k: tuple(v.shape) for k, v in named.items()}, require_all=False)
            self._rewritten({p for t in targets.values() for p in self._pieces_of(model, t)})

    def _rewritten(self, written: set) -> None:
        self.inconsistent -= written
        if not self.inconsistent:
            self.inconsistent_reason = ""

    def _fail(self, reason: str, written: set, pieces: dict) -> str:
        if not written:
            return f"{reason}; the weights update group was destroyed, old weights keep serving"
        self._mark(reason, pieces)
        return (f"{reason} after part of the weights were copied; the weights update group was destroyed and the "
                f"weights are half-updated: generation is refused (503) until an update rewrites them")

    def _mark(self, reason: str, pieces: dict[str, set]) -> None:
        """Every piece the failed update was to write: the model mixes its new and old values."""
        for ps in pieces.values():
            self.inconsistent |= ps
        self.inconsistent_reason = reason
        logger.error("weights left inconsistent (%d parameter pieces): %s", len(self.inconsistent), reason)

    def shutdown(self) -> None:
        if self.group is not None:
            self._destroy()

