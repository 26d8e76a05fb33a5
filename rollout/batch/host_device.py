"""The step's host<->device copies: its small host tensors onto the device without stalling the
host (to_device, stage), and its reads of device results with one wait (HostReads).

Staging: on CUDA each tensor is copied into pinned memory (PyTorch's caching host allocator: the
block is reused only after the copy that reads it has run) and sent with a non_blocking copy, so
the host goes on building the step while the copy runs; `stage` sends several int64 vectors in
one copy. On CPU the device is the host: nothing is copied and `stage` returns the tensors
themselves (packing them cost ~0.2 ms a step there, for nothing); tests run its packing on CPU
with pack=True.

Reading back: a read of a device tensor on the host (.tolist(), .item(), bool(), .cpu()) waits
for every kernel queued before it. A step needs its results once: the sampled ids, their
logprobs, whether each row's logits were finite (and the top logprobs when asked). `read` starts
a non_blocking copy of each to the host (pinned), waits once for the stream, then converts them,
so a decode step waits on the device exactly once; `count` says how many times it has (tests and
the step benchmark read it). `strict()` makes, on CUDA, every other host sync inside it an error
(torch.cuda.set_sync_debug_mode): a debugging and test aid. On CPU there is nothing to wait for.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

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


class HostReads:
    def __init__(self) -> None:
        self.count = 0
        self._strict = False

    def read(self, columns: Sequence[torch.Tensor]) -> list[list]:
        """columns: tensors on one device -> each as a host list (.tolist()), after one wait."""
        self.count += 1
        host = [c.to("cpu", non_blocking=True) for c in columns]
        if any(c.is_cuda for c in columns):
            if self._strict:
                torch.cuda.set_sync_debug_mode("default")
            try:
                torch.cuda.current_stream().synchronize()
            finally:
                if self._strict:
                    torch.cuda.set_sync_debug_mode("error")
        return [h.tolist() for h in host]

    @contextmanager
    def strict(self) -> Iterator[None]:
        """CUDA only: inside, any host sync but these reads raises a RuntimeError."""
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        self._strict = True
        try:
            yield
        finally:
            self._strict = False
            torch.cuda.set_sync_debug_mode(before)
