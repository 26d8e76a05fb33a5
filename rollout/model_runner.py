"""ModelRunner: turns a ScheduledBatch into a ForwardBatch and runs the model (eager)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from capture.gather_layout import GatherLayout
from rollout.forward_batch import ForwardBatch
from rollout.forward_output import ForwardOutput
from rollout.kv_pool import KVPool
from rollout.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, *, model: torch.nn.Module, kv_pool: KVPool, device: torch.device,
                 capture_buffer: Optional[Any] = None):
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        self.capture_buffer = capture_buffer

    def build_forward_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        input_ids: list[int] = []
        for req, pre, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            input_ids += req.fill_ids[pre:pre + ext]
        return ForwardBatch.build(
            input_ids=input_ids, out_cache_loc=batch.out_cache_loc, prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens, req_slots=[r.kv_slots for r in batch.reqs],
            kv_pool=self.kv_pool, capture=self.capture_buffer, device=self.device)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> ForwardOutput:
        fb = self.build_forward_batch(batch)
        logits = self.model(fb)
        return ForwardOutput(logits=logits.float(), layout=GatherLayout.packed("eager", (fb.num_tokens,)))
