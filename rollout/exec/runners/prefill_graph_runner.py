"""PrefillGraphRunner: steps of up to a bucket's token count, padded to exactly that many tokens.

Token-indexed inputs (ids, positions, KV write slots) are static per bucket. The attention grid
stays per step (a static prefill grid would be requests x tokens x context), so the forward runs
through a PiecewiseBackend: CUDA graphs of everything between the attention cores on a GPU, the
same pieces as plain calls on CPU.
"""
from __future__ import annotations

from typing import Any, Optional

from rollout.exec.runners.static_inputs import StaticInputs
from rollout.exec.runners.static_shape_runner import StaticShapeRunner


class PrefillGraphRunner(StaticShapeRunner):
    name = "prefill_graph"
    tag_runner = "prefill"
    size_label = "tokens"

    def extent(self, size: int) -> int:
        return size

    def make_inputs(self, size: int) -> StaticInputs:
        return StaticInputs(tokens=size, device=self.device)

    def pad_chunk(self, batch: Optional[Any]) -> int:
        # padding requests no longer than the longest real one keep the attention grid small
        return max(batch.extend_lens) if batch is not None else 1
