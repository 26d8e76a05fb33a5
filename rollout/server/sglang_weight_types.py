"""Our equivalents of the SGLang classes that appear inside a pickled weight push, so that the
bytes SGLang's and verl's trainers build (`MultiprocessingSerializer.serialize`) load here without
SGLang installed: the unpickler resolves SGLang's module paths to these (pickled_tensors.py).

Field names follow SGLang's definitions (model_executor/model_runner.py `LocalSerializedTensor`,
weight_sync/tensor_bucket.py `FlattenedTensorMetadata` / `FlattenedTensorBucket`,
utils/patch_torch.py `_rebuild_cuda_tensor_modified`): a pickle restores an instance's __dict__,
so the attribute names are the contract.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

# NOTE: SGLang's patched reduce_tensor puts the device's UUID in place of its index at this
# position of rebuild_cuda_tensor's arguments (so that a receiver with another CUDA_VISIBLE_DEVICES
# order finds the same GPU)
CUDA_DEVICE_ARG = 6


@dataclass
class LocalSerializedTensor:
    """One tensor per TP rank, each itself a ForkingPickler pickle (values[r] is rank r's)."""

    values: list


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """Tensors flattened (as uint8 or one dtype) into one buffer, with their metadata (what a
    pickled bucket restores: the server only reads it)."""

    def __init__(self, flattened_tensor: Optional[torch.Tensor] = None, metadata: Optional[list] = None):
        self.flattened_tensor = flattened_tensor
        self.metadata = list(metadata or [])


def _cuda_index(device: Any) -> int:
    if not isinstance(device, str):
        return device
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == device:
            return i
    raise ValueError(f"no visible CUDA device has the UUID {device!r} named by the pushed tensor")


def rebuild_cuda_tensor_modified(*args: Any) -> torch.Tensor:
    """SGLang's `_rebuild_cuda_tensor_modified`: torch's CUDA IPC rebuild with the device given by UUID."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(args)
    if len(args) > CUDA_DEVICE_ARG:
        args[CUDA_DEVICE_ARG] = _cuda_index(args[CUDA_DEVICE_ARG])
    return rebuild_cuda_tensor(*args)
