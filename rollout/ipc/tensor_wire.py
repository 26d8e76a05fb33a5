"""Named tensors on the wire between the front end and an engine process: [name, dtype, shape,
raw bytes] lists (no pickles), as weight swaps carry them."""
from __future__ import annotations

from typing import Any

import torch


def tensors_to_wire(staged: dict[str, torch.Tensor]) -> list[list[Any]]:
    """HF-named tensors as [name, dtype, shape, raw bytes] (no pickles on the wire)."""
    out = []
    for name, t in staged.items():
        t = t.detach().to("cpu").contiguous()
        out.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes()])
    return out


def tensors_from_wire(items: list[list[Any]]) -> dict[str, torch.Tensor]:
    out = {}
    for name, dtype, shape, data in items:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out[name] = raw.view(getattr(torch, dtype)).reshape(shape)
    return out
