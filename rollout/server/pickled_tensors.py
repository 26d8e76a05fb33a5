"""SGLang's `serialized_named_tensors`: base64 of a torch ForkingPickler pickle (tensors shared by
CUDA IPC handle or shared-memory file name, not copied), as colocated trainers (slime) send it.

Loaded only when `rollout-serve --allow-pickled-weight-tensors` is set. Even then the unpickler
resolves only an allow-list of globals (torch's tensor/storage rebuild functions, dtypes, Size,
OrderedDict and SGLang's FlattenedTensorMetadata), so a crafted pickle cannot name os.system; but
a pickle can still reference any shared memory the server may open: only for a trusted trainer.
"""
from __future__ import annotations

import collections
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

LOAD_FORMATS = (None, "safetensors", "direct", "flattened_bucket")
_REBUILD_MODULES = ("torch.multiprocessing.reductions", "torch._utils", "torch.storage")


@dataclass
class FlattenedTensorMetadata:
    """The fields of SGLang's weight_sync.tensor_bucket.FlattenedTensorMetadata."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("sglang.") and name == "FlattenedTensorMetadata":
            return FlattenedTensorMetadata
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module == "torch" and name in ("Tensor", "UntypedStorage", "TypedStorage", "device"):
            return getattr(torch, name)
        if module in _REBUILD_MODULES and (name.startswith("rebuild_") or name.startswith("_rebuild_")
                                           or name in ("_load_from_bytes", "UntypedStorage", "TypedStorage")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not on the allow-list")


def load_serialized_named_tensors(raw: bytes, load_format: Any) -> dict[str, torch.Tensor]:
    """The unpickled bytes of one rank's serialized_named_tensors -> {name: tensor}. Raises ValueError."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}"[:300])
    try:
        obj = _AllowListUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001 (unpickling raises many kinds)
        raise ValueError(f"serialized_named_tensors cannot be loaded: {type(exc).__name__}: {exc}"[:400]) from None
    if load_format == "flattened_bucket":
        return _from_bucket(obj)
    pairs = obj.items() if isinstance(obj, dict) else obj
    try:
        named = {str(n): t for n, t in pairs}
    except (TypeError, ValueError):
        raise ValueError("serialized_named_tensors must hold (name, tensor) pairs") from None
    if not all(isinstance(t, torch.Tensor) for t in named.values()):
        raise ValueError("serialized_named_tensors must hold (name, tensor) pairs")
    return named


def _from_bucket(obj: Any) -> dict[str, torch.Tensor]:
    if not isinstance(obj, dict) or not isinstance(obj.get("flattened_tensor"), torch.Tensor) \
            or not isinstance(obj.get("metadata"), list):
        raise ValueError("a flattened_bucket must be {'flattened_tensor': tensor, 'metadata': [...]}")
    flat = obj["flattened_tensor"].reshape(-1)
    named = {}
    for m in obj["metadata"]:
        if not isinstance(m, FlattenedTensorMetadata) or not 0 <= m.start_idx <= m.end_idx <= flat.numel() \
                or m.end_idx - m.start_idx != m.numel:
            raise ValueError("flattened_bucket metadata entry out of range or malformed")
        named[str(m.name)] = flat[m.start_idx:m.end_idx].view(m.dtype).reshape(tuple(m.shape))
    return named
