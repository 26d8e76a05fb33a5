"""GraphCaptureProfiler: one torch.profiler trace per captured shape, named by its CaptureTag.

The tag is built in the capture loop right before each capture from the loop's own variables
(runner, bucket size, DP rank), never from a counter into a list: `decode_bs8_rank0`,
`prefill_tokens64_rank1`.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

@dataclass(frozen=True)
class CaptureTag:
    runner: str        # "decode" | "prefill"
    size_label: str    # "bs" | "tokens"
    size: int
    rank: int

    @property
    def name(self) -> str:
        return f"{self.runner}_{self.size_label}{self.size}_rank{self.rank}"


class GraphCaptureProfiler:
    def __init__(self, out_dir: Optional[str]):
        """out_dir None: profiling off (capturing() is a no-op)."""
        self.out_dir = out_dir
        self.written: list[str] = []
        if out_dir is not None:
            os.makedirs(out_dir, exist_ok=True)

    @property
    def enabled(self) -> bool:
        return self.out_dir is not None

    @contextlib.contextmanager
    def capturing(self, tag: CaptureTag) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        path = os.path.join(self.out_dir, f"{tag.name}.json")
        if path in self.written:
            raise RuntimeError(f"graph capture profile {tag.name!r} written twice: the capture loop "
                               f"repeated a shape")
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities, record_shapes=True) as prof:
            with record_function(f"graph_capture[{tag.name}]"):
                yield
        prof.export_chrome_trace(path)
        self.written.append(path)
