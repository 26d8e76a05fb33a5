"""SGLang's `serialized_named_tensors`: base64 of a torch ForkingPickler pickle (tensors shared by
CUDA IPC handle, shared-memory file name or a passed file descriptor, not copied), as colocated
trainers (slime, verl, SGLang's own weight_sync) send it.

Loaded only when `rollout-serve --allow-pickled-weight-tensors` is set. Even then the unpickler
resolves only SGLang's safe set (its SafeUnpickler): builtin containers, torch's tensor and storage
rebuild functions, dtypes and Size, multiprocessing's fd passing (resource_sharer.DupFd), and
SGLang's own LocalSerializedTensor / FlattenedTensorBucket / FlattenedTensorMetadata /
_rebuild_cuda_tensor_modified, resolved to our equivalents (sglang_weight_types.py). A crafted
pickle cannot name os.system or builtins.eval; but it can still reference any shared memory or fd
the server may open: only for a trusted trainer.
"""
from __future__ import annotations

import base64
import binascii
import builtins
import collections
import io
import multiprocessing.reduction
import multiprocessing.resource_sharer
import pickle
from typing import Any

import torch
import torch._utils
import torch.multiprocessing.reductions

from rollout.server import sglang_weight_types as sgl

LOAD_FORMATS = (None, "safetensors", "direct", "flattened_bucket")
_BUILTINS = frozenset({"list", "dict", "tuple", "set", "frozenset", "bytearray", "bytes", "str", "int", "float",
                       "bool", "complex", "slice", "range"})
_COLLECTIONS = frozenset({"OrderedDict", "defaultdict", "deque", "Counter"})
_TORCH_UTILS = frozenset({"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                          "_rebuild_from_type_v2", "_rebuild_meta_tensor_no_storage"})
_TORCH_CLASSES = frozenset({"Size", "Tensor", "UntypedStorage", "TypedStorage", "device"})
_MODEL_RUNNER = ("sglang.srt.model_executor.model_runner",
                 "sglang.srt.model_executor.model_runner_components.weight_updater")
_TENSOR_BUCKET = "sglang.srt.weight_sync.tensor_bucket"


def _load_storage_from_bytes(data: bytes) -> Any:
    """torch.storage._load_from_bytes, but through torch's weights-only unpickler."""
    return torch.load(io.BytesIO(data), weights_only=True)


_EXACT: dict[tuple[str, str], Any] = {
    ("multiprocessing.resource_sharer", "DupFd"): multiprocessing.resource_sharer.DupFd,
    ("multiprocessing.reduction", "_rebuild_socket"): multiprocessing.reduction._rebuild_socket,
    ("multiprocessing.reduction", "_rebuild_partial"): getattr(multiprocessing.reduction, "_rebuild_partial", None),
    ("torch.storage", "_load_from_bytes"): _load_storage_from_bytes,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.TypedStorage,
    ("torch._tensor", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): sgl.rebuild_cuda_tensor_modified,
    (_TENSOR_BUCKET, "FlattenedTensorMetadata"): sgl.FlattenedTensorMetadata,
    (_TENSOR_BUCKET, "FlattenedTensorBucket"): sgl.FlattenedTensorBucket,
    **{(m, "LocalSerializedTensor"): sgl.LocalSerializedTensor for m in _MODEL_RUNNER},
}


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _EXACT.get((module, name))
        if found is not None:
            return found
        if module == "builtins" and name in _BUILTINS:
            return getattr(builtins, name)
        if module == "collections" and name in _COLLECTIONS:
            return getattr(collections, name)
        if module == "torch" and (name in _TORCH_CLASSES or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module == "torch._utils" and name in _TORCH_UTILS:
            return getattr(torch._utils, name)
        if module == "torch.multiprocessing.reductions" and name.startswith("rebuild_") \
                and callable(getattr(torch.multiprocessing.reductions, name, None)):
            return getattr(torch.multiprocessing.reductions, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not on the allow-list")


def unpickle(raw: bytes) -> Any:
    """One ForkingPickler pickle -> its object, through the allow-list. Raises ValueError."""
    try:
        return _AllowListUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001 (unpickling raises many kinds)
        hint = ""
        if isinstance(exc, multiprocessing.AuthenticationError):
            hint = (" (a tensor shared by file descriptor, torch's default CPU strategy, is fetched from the "
                    "sender's multiprocessing listener: start rollout-serve through multiprocessing from the "
                    "trainer, or with ROLLOUT_MP_AUTHKEY set to the trainer's authkey in hex, or use "
                    "torch.multiprocessing.set_sharing_strategy('file_system'))")
        raise ValueError(f"serialized_named_tensors cannot be loaded: {type(exc).__name__}: {exc}"[:400]
                         + hint) from None


def load_serialized_named_tensors(raw: bytes, load_format: Any) -> dict[str, torch.Tensor]:
    """The unpickled bytes of one rank's serialized_named_tensors -> {name: tensor}. Raises ValueError."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}"[:300])
    obj = unpickle(raw)
    if load_format == "flattened_bucket":
        return _from_bucket(obj)
    pairs = obj.items() if isinstance(obj, dict) else obj
    try:
        named = {str(n): _local_tensor(t) for n, t in pairs}
    except (TypeError, ValueError) as exc:
        if str(exc).startswith("serialized_named_tensors"):
            raise
        raise ValueError("serialized_named_tensors must hold (name, tensor) pairs") from None
    if not all(isinstance(t, torch.Tensor) for t in named.values()):
        raise ValueError("serialized_named_tensors must hold (name, tensor) pairs")
    return named


def _local_tensor(value: Any) -> Any:
    """A LocalSerializedTensor holds one pickle per TP rank; this server is rank 0 (SGLang's _unwrap_tensor)."""
    if not isinstance(value, sgl.LocalSerializedTensor):
        return value
    values = getattr(value, "values", None)
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError("serialized_named_tensors: a LocalSerializedTensor holds no values")
    inner = values[0]
    if isinstance(inner, str):
        try:
            inner = base64.b64decode(inner, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("serialized_named_tensors: a LocalSerializedTensor value is not valid base64") from None
    if not isinstance(inner, (bytes, bytearray)):
        raise ValueError("serialized_named_tensors: a LocalSerializedTensor value must be bytes")
    tensor = unpickle(bytes(inner))
    if not isinstance(tensor, torch.Tensor):
        raise ValueError("serialized_named_tensors: a LocalSerializedTensor must hold a tensor")
    return tensor


def _from_bucket(obj: Any) -> dict[str, torch.Tensor]:
    if isinstance(obj, sgl.FlattenedTensorBucket):
        obj = {"flattened_tensor": getattr(obj, "flattened_tensor", None), "metadata": getattr(obj, "metadata", None)}
    if not isinstance(obj, dict) or not isinstance(obj.get("flattened_tensor"), torch.Tensor) \
            or not isinstance(obj.get("metadata"), list):
        raise ValueError("a flattened_bucket must be {'flattened_tensor': tensor, 'metadata': [...]}")
    flat = obj["flattened_tensor"].reshape(-1)
    named = {}
    for m in obj["metadata"]:
        if not isinstance(m, sgl.FlattenedTensorMetadata) or not isinstance(m.dtype, torch.dtype) \
                or not 0 <= m.start_idx <= m.end_idx <= flat.numel() or m.end_idx - m.start_idx != m.numel:
            raise ValueError("flattened_bucket metadata entry out of range or malformed")
        try:
            named[str(m.name)] = flat[m.start_idx:m.end_idx].view(m.dtype).reshape(tuple(m.shape))
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"flattened_bucket entry {str(m.name)[:100]!r} does not fit its metadata: {exc}"[:300]) \
                from None
    return named


AUTHKEY_ENV = "ROLLOUT_MP_AUTHKEY"


def adopt_authkey(environ: dict) -> bool:
    """Takes the trainer's multiprocessing authkey (hex, in ROLLOUT_MP_AUTHKEY) as this process's.

    NOTE: a tensor shared by file descriptor (torch's default CPU strategy) is fetched from the
    sender's multiprocessing listener, which admits only processes with its authkey; a server
    started through multiprocessing inherits it, one started as a plain subprocess needs this."""
    import multiprocessing

    value = environ.get(AUTHKEY_ENV)
    if not value:
        return False
    try:
        key = bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{AUTHKEY_ENV} must be hex digits (multiprocessing.current_process().authkey.hex())") \
            from None
    multiprocessing.current_process().authkey = key
    return True
