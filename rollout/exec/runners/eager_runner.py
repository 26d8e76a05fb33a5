"""EagerRunner: runs a batch at its own shape; under DP the ranks' tokens are packed (no padding)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from capture.capturer import GatherLayout
from rollout.exec.forward_output import ForwardOutput
from rollout.batch.kv_pool import KVPool
from rollout.exec.runners.padded_batch import padded_forward_batch
from rollout.exec.runners.runner_plan import EAGER, RunnerChoice


class EagerRunner:
    name = EAGER

    def __init__(self, *, model: torch.nn.Module, kv_pool: KVPool, device: torch.device,
                 capture_buffer: Optional[Any] = None, ep_group: Optional[Any] = None,
                 attention: Optional[Any] = None):
        self.model = model
        self.attention = attention
        self.kv_pool = kv_pool
        self.device = device
        self.capture_buffer = capture_buffer
        self.ep_group = ep_group

    def forward(self, batch: Optional[Any], counts: tuple[int, ...],
                choice: Optional[RunnerChoice] = None, all_logits: bool = False) -> ForwardOutput:
        """batch: this rank's ScheduledBatch, or None (idle: an empty forward that joins the collectives).
        all_logits: also return every token's logits (token rows request-major, no padding)."""
        layout = GatherLayout.packed(self.name, counts)
        fb = padded_forward_batch(batch, kv_pool=self.kv_pool, device=self.device, capture=self.capture_buffer,
                                  segment_attention=True)
        fb = dataclasses.replace(fb, layout=layout, ep_group=self.ep_group)
        if self.attention is not None:
            fb = self.attention.bind(fb, static=False)
        if all_logits:
            full = self.model(fb, return_all_logits=True).float()               # [N, vocab]
            return ForwardOutput(logits=full[fb.logits_indices], layout=layout, token_logits=full)
        logits = self.model(fb)
        return ForwardOutput(logits=logits.float(), layout=layout)
