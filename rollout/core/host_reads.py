"""HostReads: the engine step's reads of device results, made in one transfer and counted.

A read of a device tensor on the host (.tolist(), .item(), bool(), .cpu()) waits for every kernel
queued before it. A step needs its results once: the sampled ids, their logprobs, whether each
row's logits were finite (and the top logprobs when asked). `read` sends them as one float64
[B, columns] transfer, so a decode step waits on the device exactly once; `count` says how many
times it has (tests and the step benchmark read it). `strict()` makes, on CUDA, every other
host sync inside it an error (torch.cuda.set_sync_debug_mode): a debugging and test aid.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch


class HostReads:
    def __init__(self) -> None:
        self.count = 0
        self._strict = False

    def read(self, columns: Sequence[torch.Tensor]) -> list[list[float]]:
        """columns: [B] or [B, k] tensors on one device (ints below 2**53, float32 or bool: all
        exact in float64) -> B host rows, each the columns side by side."""
        self.count += 1
        packed = torch.cat([c.reshape(c.shape[0], -1).to(torch.float64) for c in columns], dim=1)  # [B, cols]
        if not self._strict:
            return packed.tolist()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return packed.tolist()
        finally:
            torch.cuda.set_sync_debug_mode("error")

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
