"""host_staging: a step's small host tensors onto the device without stalling the host.

On CUDA each tensor is copied into pinned memory (PyTorch's caching host allocator: the block is
reused only after the copy that reads it has run) and sent with a non_blocking copy, so the host
goes on building the step while the copy runs; `stage` sends several int64 vectors in one copy.
On CPU the device is the host: nothing is copied and `stage` returns the tensors themselves
(packing them cost ~0.2 ms a step there, for nothing); tests run its packing on CPU with pack=True.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device`: itself when it is there already, else a non_blocking copy (pinned on CUDA)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def stage(parts: Sequence[torch.Tensor], device: torch.device, *, pack: Optional[bool] = None) -> list[torch.Tensor]:
    """1-D int64 tensors -> the same on `device`: the host ones sent as one buffer (views into
    it), any already elsewhere moved on their own. pack (default: only when `device` is not the
    host; on CPU the concatenation would cost more than the whole copy saves) forces either way."""
    if pack is None:
        pack = device.type != "cpu"
    if not pack:
        return [to_device(p, device) for p in parts]
    host = [i for i, p in enumerate(parts) if p.device.type == "cpu"]
    out = [p if p.device.type == "cpu" else to_device(p, device) for p in parts]
    if host:
        flat = to_device(torch.cat([parts[i].reshape(-1) for i in host]), device)   # [sum of sizes] int64
        for i, view in zip(host, flat.split([int(parts[i].numel()) for i in host])):
            out[i] = view
    return out
