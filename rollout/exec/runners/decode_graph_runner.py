"""DecodeGraphRunner: decode-shaped steps (one new token per request) padded to a batch-size bucket."""
from __future__ import annotations

from typing import Any, Optional

from rollout.exec.runners.static_inputs import StaticInputs
from rollout.exec.runners.static_shape_runner import StaticShapeRunner


class DecodeGraphRunner(StaticShapeRunner):
    """Bucket = batch size; padding requests of one token each fill the batch up to it.

    seq_capacity: keys per request in the static attention grid (the context length) when the
    grid must be static (CUDA graphs); None keeps the step's own trimmed grid (CPU).
    NOTE: a static grid gathers bucket x seq_capacity keys per layer on every replay (the models
    attend with SDPA over gathered KV); with long contexts and large buckets that is the memory
    and time limit of this runner, until a paged attention kernel replaces the gather.
    """

    name = "decode_graph"
    tag_runner = "decode"
    size_label = "bs"

    def __init__(self, *, seq_capacity: Optional[int] = None, **kw: Any):
        self.seq_capacity = seq_capacity
        super().__init__(**kw)

    def extent(self, size: int) -> int:
        return size

    def make_inputs(self, size: int) -> StaticInputs:
        return StaticInputs(tokens=self.extent(size), requests=size, seq_capacity=self.seq_capacity,
                            device=self.device)

    def pad_chunk(self, batch: Optional[Any]) -> int:
        return 1
