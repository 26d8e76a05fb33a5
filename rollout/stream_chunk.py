"""StreamChunk: what one streamed step of one request adds to its output."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rollout.output import RolloutOutput


@dataclass(frozen=True, kw_only=True)
class StreamChunk:
    rid: str
    output_ids: list[int]                          # new tokens since the previous chunk
    text: str                                      # new text since the previous chunk
    output_logprobs: Optional[list[float]] = None
    output_top_logprobs: Optional[list[list[tuple[float, int]]]] = None
    routed_experts: Optional[torch.Tensor] = None  # [rows, L, K] rows final since the previous chunk
    routed_experts_start: int = 0                  # absolute position of routed_experts[0]
    finished: bool = False
    output: Optional[RolloutOutput] = None         # the whole result, on the last chunk
