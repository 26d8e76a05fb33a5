"""A colocated trainer in a process of its own: shares its tensors with rollout-serve the way
SGLang-based trainers do (torch's ForkingPickler: by file descriptor or shared-memory file name,
never copied) and pushes them while it stays alive, as the trainer process does.

`python tests/colocated_trainer.py URL ADMIN_KEY WEIGHTS_FILE STRATEGY FORM OUT` writes OUT (JSON): the
status and body of each call (a file: torch's shm manager, started under file_system, keeps the
trainer's stdout open after it exits). FORM:
- `pairs`: a list of (name, tensor) pairs, load_format null;
- `sglang`: what sglang's weight_sync.update_weights builds and its HttpServerEngineAdapter sends
  (verl's path): each tensor serialized on its own and wrapped in a LocalSerializedTensor (one
  value per TP rank), the list serialized again, one base64 entry per TP rank, inside a
  begin/end weight-update session;
- `bucket`: slime's flattened_bucket dict.
"""
from __future__ import annotations

import base64
import dataclasses
import io
import json
import multiprocessing
import os
import sys
import types

import httpx
import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler
from safetensors.torch import load_file

TP_SIZE = 1


def _sglang_module(name: str, **classes) -> None:
    """Stand-ins for the SGLang classes (sglang is not installed): same module path and fields."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    for cls_name, cls in classes.items():
        cls.__module__, cls.__qualname__ = name, cls_name
        setattr(sys.modules[name], cls_name, cls)


@dataclasses.dataclass
class LocalSerializedTensor:
    values: list


@dataclasses.dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_sglang_module("sglang.srt.model_executor.model_runner", LocalSerializedTensor=LocalSerializedTensor)
_sglang_module("sglang.srt.weight_sync.tensor_bucket", FlattenedTensorMetadata=FlattenedTensorMetadata)


def serialize(obj, output_str: bool = False):
    """sglang.srt.utils.MultiprocessingSerializer.serialize."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    out = buf.getvalue()
    return base64.b64encode(out).decode() if output_str else out


def body_for(form: str, tensors: dict[str, torch.Tensor]) -> dict:
    named = list(tensors.items())
    if form == "pairs":
        return {"serialized_named_tensors": [serialize(named, output_str=True)], "load_format": None}
    if form == "sglang":
        wrapped = [(n, LocalSerializedTensor(values=[serialize(t.detach()) for _ in range(TP_SIZE)])) for n, t in named]
        return {"serialized_named_tensors": [serialize(wrapped, output_str=True) for _ in range(TP_SIZE)],
                "load_format": None, "flush_cache": True}
    if form == "bucket":
        flat, meta, pos = [], [], 0
        for n, t in named:
            b = t.contiguous().flatten().view(torch.uint8)
            meta.append(FlattenedTensorMetadata(n, t.shape, t.dtype, pos, pos + b.numel(), b.numel()))
            flat.append(b)
            pos += b.numel()
        return {"serialized_named_tensors": [serialize({"flattened_tensor": torch.cat(flat), "metadata": meta},
                                                       output_str=True)], "load_format": "flattened_bucket"}
    raise SystemExit(f"unknown form {form!r}")


def main(url: str, admin_key: str, weights_file: str, strategy: str, form: str, out_path: str) -> None:
    multiprocessing.current_process().authkey = bytes.fromhex(os.environ["ROLLOUT_MP_AUTHKEY"])
    mp.set_sharing_strategy(strategy)
    tensors = load_file(weights_file)
    body = dict(body_for(form, tensors), weight_version=f"{form}-{strategy}")
    headers = {"Authorization": f"Bearer {admin_key}"}
    calls = ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"] if form == "sglang" \
        else ["/update_weights_from_tensor"]
    out = {}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
        for path in calls:
            r = c.post(path, json=body if path == "/update_weights_from_tensor" else {})
            out[path] = [r.status_code, r.json()]
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:7])
