"""HostReads: the engine step's reads of device results, made with one wait and counted.

A read of a device tensor on the host (.tolist(), .item(), bool(), .cpu()) waits for every kernel
queued before it. A step needs its results once: the sampled ids, their logprobs, whether each
row's logits were finite (and the top logprobs when asked). `read` starts a non_blocking copy of
each to the host (pinned), waits once for the stream, then converts them, so a decode step waits
on the device exactly once; `count` says how many times it has (tests and the step benchmark
read it). `strict()` makes, on CUDA, every other host sync inside it an error
(torch.cuda.set_sync_debug_mode): a debugging and test aid. On CPU there is nothing to wait for.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch


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
