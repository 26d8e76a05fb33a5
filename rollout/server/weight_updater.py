"""WeightUpdater: new weights from disk, from safetensors bytes, or broadcast over torch.distributed.

Disk and tensor updates are all-or-nothing: names, shapes and dtypes are checked against the
model first, the tensors are staged (already in the parameters' dtype, float ones for FP8 weights
in the dtype sent, quantized when installed; and checked finite), and
only then swapped in by the engine between two steps (Rollout.swap_weights), which also flushes
the prefix cache and sets weight_version. On any failure nothing was copied: the old weights keep
serving and the error says why. Never unpickles anything.

Distributed updates pass no tensor through this process: it checks the metadata and forwards it;
the engine processes are the group's members and receive into their parameters bucket by bucket
(rollout/core/weight_receiver.py, which says what a failure mid-way leaves).
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, Callable, Optional

import torch

from rollout.ipc.control_values import GROUP_BACKENDS as BACKENDS, LOAD_FORMATS, WEIGHT_DTYPES as DTYPES
from rollout.models.loader import _checkpoint_files, plan
from rollout.models.quant.fp8 import FP8_DTYPE, fp8_finite

logger = logging.getLogger(__name__)
DEFAULT_GROUP_TIMEOUT_S = 300.0
MAX_TENSORS = 1_000_000
MAX_WEIGHT_VERSION_CHARS = 256


class WeightUpdateError(ValueError):
    """A rejected update (nothing applied); status is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _is_under(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:
        return False


def _dtype(name: Any) -> torch.dtype:
    if not isinstance(name, str) or name.removeprefix("torch.") not in DTYPES:
        raise WeightUpdateError(f"dtypes entries must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name.removeprefix("torch.")]


class WeightUpdater:
    def __init__(self, engine: Any, allowed_dirs: tuple[str, ...], *,
                 on_update: Optional[Callable[[str, float], None]] = None):
        """on_update(source, seconds): after each update that succeeded ("disk", "tensor" or
        "distributed"; from the call to the new weights serving)."""
        self.engine = engine
        self.allowed_dirs = tuple(os.path.realpath(d) for d in allowed_dirs)
        self._swap_lock = threading.Lock()
        self.on_update = on_update or (lambda source, seconds: None)

    # ---- validation and staging --------------------------------------------------------------------
    def stage(self, named: dict[str, torch.Tensor], *, require_all: bool, source: str) -> dict[str, torch.Tensor]:
        """Checks every name/shape/dtype/value, then returns copies in the parameters' dtype and device."""
        if not named:
            raise WeightUpdateError(f"{source} holds no tensors")
        model = self.engine.model
        try:
            targets = plan(model, {k: tuple(v.shape) for k, v in named.items()}, require_all=require_all,
                           source=source)
        except ValueError as exc:
            raise WeightUpdateError(str(exc)) from None
        params = dict(model.named_parameters())
        bad = [f"{k} ({v.dtype})" for k, v in named.items() if k in targets and not v.is_floating_point()]
        if bad:
            raise WeightUpdateError(f"{source}: tensors must be floating point, got {', '.join(bad[:10])}")
        staged = {}
        for key, t in targets.items():
            param = params[t.param]
            # NOTE: the named tensors were made by this updater (read, parsed or received), so a
            # no-op .to() sharing their storage is fine: nobody else holds them.
            # (DP: the model here is a meta-device skeleton; staging stays on the CPU for the ranks)
            device = "cpu" if param.device.type == "meta" else param.device
            # NOTE: a float tensor for an FP8 weight stays in the dtype sent: the engine quantizes it
            # when it is installed (a cast to float8 here would drop its scale)
            dtype = named[key].dtype if param.dtype == FP8_DTYPE else param.dtype
            value = named[key].to(device=device, dtype=dtype).contiguous()
            if not (fp8_finite(value) if value.dtype == FP8_DTYPE else bool(torch.isfinite(value).all())):
                raise WeightUpdateError(f"{source}: tensor {key!r} holds NaN or infinite values")
            staged[key] = value
        if not staged:
            raise WeightUpdateError(f"{source} holds no tensor for this model (only ignored names)")
        return staged

    def _swap(self, staged: dict[str, torch.Tensor] | Callable[[], dict[str, torch.Tensor]], weight_version: Any,
              abort_all_requests: Any, source: str, started: float) -> dict:
        with self._swap_lock:
            count = self.engine.swap_weights(staged, weight_version=weight_version,
                                             abort_all_requests=abort_all_requests)
        self.on_update(source, time.perf_counter() - started)
        version = self.engine.weight_version
        logger.info("weights updated from %s: %d tensors, weight_version=%s", source, count, version)
        return {"success": True, "message": f"updated {count} tensors from {source}; prefix cache flushed",
                "num_tensors": count, "weight_version": version}

    @staticmethod
    def check_common(weight_version: Any, abort_all_requests: Any) -> None:
        if weight_version is not None and (not isinstance(weight_version, str) or not weight_version
                                           or len(weight_version) > MAX_WEIGHT_VERSION_CHARS
                                           or not weight_version.isprintable()):
            raise WeightUpdateError(f"weight_version must be a non-empty string of at most "
                                    f"{MAX_WEIGHT_VERSION_CHARS} printable characters, got {ascii(weight_version)}"[:300])
        if not isinstance(abort_all_requests, bool):
            raise WeightUpdateError(f"abort_all_requests must be a boolean, got {abort_all_requests!r}")

    # ---- from disk -------------------------------------------------------------------------------
    def _resolve_dir(self, model_path: Any) -> str:
        if not isinstance(model_path, str) or not model_path or "\x00" in model_path:
            raise WeightUpdateError(f"model_path must be a non-empty path string, got {model_path!r}"[:300])
        real = os.path.realpath(model_path)
        if not any(_is_under(real, d) for d in self.allowed_dirs):
            raise WeightUpdateError("model_path is outside the directories this server may read weights from "
                                    "(the model's own directory and --allowed-weight-dirs)", status=403)
        if not os.path.isdir(real):
            raise WeightUpdateError(f"model_path {model_path!r} is not a directory")
        return real

    def checkpoint_files(self, model_path: Any) -> list:
        """The checkpoint's files, each checked to resolve inside the allowed directories (cheap:
        reads at most its index.json)."""
        real = self._resolve_dir(model_path)
        try:
            files = _checkpoint_files(real)
        except (ValueError, OSError, KeyError, TypeError) as exc:
            raise WeightUpdateError(f"cannot read checkpoint in {model_path!r}: {exc}") from None
        for f in files:
            if not any(_is_under(os.path.realpath(f), d) for d in self.allowed_dirs):
                raise WeightUpdateError(f"checkpoint file {f.name!r} resolves outside the allowed weight "
                                        f"directories", status=403)
        return files

    @staticmethod
    def read_files(files: list) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        named: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                with safe_open(os.path.realpath(f), framework="pt") as st:
                    for key in st.keys():
                        if key in named:
                            raise WeightUpdateError(f"tensor {key!r} appears in two checkpoint files")
                        named[key] = st.get_tensor(key)
            except WeightUpdateError:
                raise
            except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types)
                raise WeightUpdateError(f"cannot read {f.name!r}: {type(exc).__name__}: {exc}") from None
        return named

    def update_from_disk(self, model_path: Any, weight_version: Any = None, abort_all_requests: Any = False) -> dict:
        """The path and file list are checked first (a refusal aborts nothing); then, as SGLang does,
        the requests are aborted (when asked) and admission held before the checkpoint is read, so
        a slow read cannot let queued requests start on the old weights meanwhile. NOTE: a
        checkpoint refused for its tensors (names, shapes, values) has then aborted them already."""
        started = time.perf_counter()
        self.check_common(weight_version, abort_all_requests)
        files = self.checkpoint_files(model_path)
        source = f"checkpoint {os.path.basename(str(model_path))!r}"
        return self._swap(lambda: self.stage(self.read_files(files), require_all=True, source=source),
                          weight_version, abort_all_requests, "disk", started)

    # ---- from tensor bytes -----------------------------------------------------------------------
    def update_from_safetensors(self, data: bytes, weight_version: Any = None,
                                abort_all_requests: Any = False) -> dict:
        from safetensors.torch import load

        started = time.perf_counter()
        self.check_common(weight_version, abort_all_requests)
        if not data:
            raise WeightUpdateError("the body holds no safetensors data")
        try:
            named = load(bytes(data))
        except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types)
            raise WeightUpdateError(f"the body is not valid safetensors data: {type(exc).__name__}: {exc}") from None
        staged = self.stage(named, require_all=False, source="tensors")
        del named
        return self._swap(staged, weight_version, abort_all_requests, "tensor", started)

    def update_from_tensors(self, named: dict[str, torch.Tensor], weight_version: Any = None,
                            abort_all_requests: Any = False, source: str = "tensors") -> dict:
        """Already deserialized HF-named tensors (e.g. SGLang's pickled form, when allowed).

        NOTE: they may share memory with the sender: copied first, so the checks hold for what is installed."""
        started = time.perf_counter()
        self.check_common(weight_version, abort_all_requests)
        named = {k: v.detach().clone() for k, v in named.items()}
        staged = self.stage(named, require_all=False, source=source)
        return self._swap(staged, weight_version, abort_all_requests, "tensor", started)

    # ---- over torch.distributed ------------------------------------------------------------------
    def init_group(self, *, master_address: Any, master_port: Any, rank_offset: Any, world_size: Any,
                   group_name: Any, backend: Any = "gloo", timeout_s: Any = DEFAULT_GROUP_TIMEOUT_S) -> dict:
        if not isinstance(master_address, str) or not master_address or any(c in master_address for c in "/ @?#"):
            raise WeightUpdateError(f"master_address must be a host name or address, got {master_address!r}"[:300])
        for name, value, lo, hi in (("master_port", master_port, 1, 65535), ("world_size", world_size, 2, 2**16),
                                    ("rank_offset", rank_offset, 1, 2**16)):
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise WeightUpdateError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}"[:300])
        dp = self.engine.config.dp_size
        if rank_offset + dp > world_size:
            raise WeightUpdateError(f"rank_offset ({rank_offset}) + this server's engine processes (dp_size {dp}) "
                                    f"must be <= world_size ({world_size}): the trainer is rank 0, DP rank r of "
                                    f"this server takes rank rank_offset + r")
        if not isinstance(group_name, str) or not group_name or len(group_name) > 128:
            raise WeightUpdateError(f"group_name must be a non-empty string, got {group_name!r}"[:300])
        if backend not in BACKENDS:
            raise WeightUpdateError(f"backend must be one of {list(BACKENDS)}, got {backend!r}"[:300])
        if backend == "nccl" and self.engine.config.device == "cpu":
            raise WeightUpdateError("backend 'nccl' needs a CUDA device; this server runs on cpu (use gloo)")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600 \
                or not math.isfinite(timeout_s):
            raise WeightUpdateError(f"timeout_s must be a number in (0, 3600], got {timeout_s!r}"[:300])
        try:
            ranks = self.engine.init_weights_update_group(
                master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                world_size=world_size, group_name=group_name, backend=backend, timeout_s=float(timeout_s))
        except ValueError as exc:
            raise WeightUpdateError(str(exc)) from None
        joined = ", ".join(str(r["rank"]) for r in ranks)
        return {"success": True, "message": f"joined weights update group {group_name!r} as rank(s) {joined}"}

    def destroy_group(self, group_name: Any = None) -> dict:
        try:
            self.engine.destroy_weights_update_group(group_name)
        except ValueError as exc:
            raise WeightUpdateError(str(exc)) from None
        return {"success": True, "message": "weights update group destroyed"}

    def update_from_distributed(self, names: Any, dtypes: Any, shapes: Any, weight_version: Any = None,
                                abort_all_requests: Any = False, load_format: Any = None) -> dict:
        """Forwards the metadata; every engine process receives the trainer's broadcasts (rank 0, in
        `names` order) itself, bucket by bucket, into its parameters. No tensor passes through here.

        NOTE: when the metadata is well formed but does not fit the model, the engines still
        receive (and drop) the tensors so the trainer's broadcasts do not hang; then the update is
        refused. Malformed metadata is refused here (nothing can be received without it).
        """
        started = time.perf_counter()
        self.check_common(weight_version, abort_all_requests)
        if not all(isinstance(x, list) for x in (names, dtypes, shapes)):
            raise WeightUpdateError("names, dtypes and shapes must be lists")
        if not len(names) == len(dtypes) == len(shapes) or not names or len(names) > MAX_TENSORS:
            raise WeightUpdateError(f"names, dtypes and shapes must be non-empty lists of equal length, got "
                                    f"{len(names)}, {len(dtypes)}, {len(shapes)}")
        if not all(isinstance(n, str) and n for n in names):
            raise WeightUpdateError("names entries must be non-empty strings")
        if len(set(names)) != len(names):
            raise WeightUpdateError("names must not repeat")
        if load_format not in LOAD_FORMATS:
            raise WeightUpdateError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}"[:300])
        torch_dtypes = [_dtype(d) for d in dtypes]
        for s in shapes:
            if not isinstance(s, list) or len(s) > 8 or not all(
                    isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in s):
                raise WeightUpdateError(f"shapes entries must be lists of non-negative integers, got {s!r}"[:300])
        # NOTE: an FP8 weight counts as fp32 here: the trainer sends it in float
        model_bytes = sum(p.numel() * (4 if p.dtype == FP8_DTYPE else p.element_size())
                          for p in self.engine.model.parameters())
        total = sum(math.prod(s) * torch.empty((), dtype=dt).element_size() for s, dt in zip(shapes, torch_dtypes))
        if total > 2 * model_bytes + 2**26:
            raise WeightUpdateError(f"the tensors announced ({total} bytes) are far larger than the model "
                                    f"({model_bytes} bytes); nothing received")
        with self._swap_lock:
            try:
                count = self.engine.update_weights_from_distributed(
                    names, [str(d).removeprefix("torch.") for d in dtypes], shapes, load_format=load_format,
                    weight_version=weight_version, abort_all_requests=abort_all_requests)
            except ValueError as exc:
                raise WeightUpdateError(str(exc)) from None
        self.on_update("distributed", time.perf_counter() - started)
        version = self.engine.weight_version
        logger.info("weights updated over torch.distributed: %d tensors, weight_version=%s", count, version)
        return {"success": True, "message": f"updated {count} tensors from distributed; prefix cache flushed",
                "num_tensors": count, "weight_version": version}
