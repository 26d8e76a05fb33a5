"""StaticInputs: one bucket's preallocated forward inputs; each step's padded batch is copied in.

Token-indexed tensors ([tokens]) are always static. With `requests` the request-indexed ones are
too, and with `seq_capacity` also the attention grid (one query per request: decode), so that a
CUDA graph captured over these buffers replays any batch of the bucket. Without a static grid the
step's own (trimmed) grid tensors are used, which is what the CPU path does to stay cheap.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from rollout.batch.forward_batch import ForwardBatch
from rollout.batch.kv_pool import SINK_SLOT


class StaticInputs:
    def __init__(self, *, tokens: int, requests: Optional[int] = None, seq_capacity: Optional[int] = None,
                 device: torch.device | str = "cpu"):
        assert seq_capacity is None or requests is not None
        dev = torch.device(device)
        self.tokens = tokens
        self.requests = requests
        self.seq_capacity = seq_capacity

        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=dev)

        self.input_ids, self.positions = longs(tokens), longs(tokens)             # [T]
        self.out_cache_loc, self.q_pad_index = longs(tokens), longs(tokens)       # [T]
        if requests is not None:
            self.seq_lens, self.extend_lens, self.logits_indices = longs(requests), longs(requests), longs(requests)
        if seq_capacity is not None:
            # NOTE: no static mask: ForwardBatch.attn_mask is made from the static seq_lens when a
            # torch path reads it (inside the graph, under CUDA graphs)
            self.kv_indices = torch.full((requests, seq_capacity), SINK_SLOT, dtype=torch.int64, device=dev)

    @property
    def static_grid(self) -> bool:
        return self.seq_capacity is not None

    def load(self, fb: ForwardBatch) -> ForwardBatch:
        """fb (padded to exactly this bucket) with its tensors moved into the static buffers."""
        assert fb.num_tokens == self.tokens, (fb.num_tokens, self.tokens)
        views = {}
        for name in ("input_ids", "positions", "out_cache_loc", "q_pad_index"):
            buf = getattr(self, name)
            buf.copy_(getattr(fb, name))
            views[name] = buf
        if self.requests is not None:
            assert fb.batch_size == self.requests, (fb.batch_size, self.requests)
            for name in ("seq_lens", "extend_lens", "logits_indices"):
                buf = getattr(self, name)
                buf.copy_(getattr(fb, name))
                views[name] = buf
        if self.static_grid:
            seq = fb.kv_indices.shape[1]
            assert fb.max_extend == 1 and seq <= self.seq_capacity, (fb.max_extend, seq, self.seq_capacity)
            self.kv_indices[:, :seq].copy_(fb.kv_indices)
            self.kv_indices[:, seq:].fill_(SINK_SLOT)
            views["kv_indices"] = self.kv_indices
        return dataclasses.replace(fb, **views)
