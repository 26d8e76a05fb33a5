"""ForwardOutput: what one forward produced and which runner (with which layout) produced it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from capture.capturer import GatherLayout


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor     # [B, vocab] fp32, one row per request (its last new token)
    layout: GatherLayout     # the executing runner's layout; capture reads only this
    token_logits: Optional[torch.Tensor] = None  # [N, vocab] fp32, every token's (prompt logprobs asked)

    @property
    def runner(self) -> str:
        """The runner that executed ("eager", "decode_graph", "prefill_graph")."""
        return self.layout.runner
