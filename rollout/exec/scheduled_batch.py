"""ScheduledBatch: one step's work as the scheduler picked it, the executor's input: the requests,
how many tokens each computes (and from which position), and their KV slots."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ScheduledBatch:
    reqs: list[Any]                  # rollout.core.request.Req (the layer above)
    extend_lens: list[int]
    prefix_lens: list[int]
    out_cache_loc: torch.Tensor      # [sum(extend_lens)] new slots, request-major
    is_prefill: bool
    kv_indices: torch.Tensor         # [B, max(prefix+extend)] int64 KV slots by position (stale past each length), on the device
    # decode: (P, batch rows) of requests whose slots for positions 0 .. P-1 are the same (DecodeCascade)
    prefix_groups: tuple = ()

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def completes(self, i: int) -> bool:
        """Whether request i's forward reaches its last token (its logits pick the next token)."""
        req = self.reqs[i]
        return self.prefix_lens[i] + self.extend_lens[i] == req.seq_len
