"""HostReads: the engine step's reads of device results, made in one transfer and counted.

A read of a device tensor on the host (.tolist(), .item(), bool(), .cpu()) waits for every kernel
queued before it. A step needs its results once: the sampled ids, their logprobs, whether each
row's logits were finite (and the top logprobs when asked). `read` sends them as one float64
[B, columns] transfer, so a decode step waits on the device exactly once; `count` says how many
times it has (tests and the step benchmark read it).
"""
from __future__ import annotations

from typing import Sequence

import torch


class HostReads:
    def __init__(self) -> None:
        self.count = 0

    def read(self, columns: Sequence[torch.Tensor]) -> list[list[float]]:
        """columns: [B] or [B, k] tensors on one device (ints below 2**53, float32 or bool: all
        exact in float64) -> B host rows, each the columns side by side."""
        self.count += 1
        packed = torch.cat([c.reshape(c.shape[0], -1).to(torch.float64) for c in columns], dim=1)  # [B, cols]
        return packed.tolist()
