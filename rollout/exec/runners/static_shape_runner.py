"""StaticShapeRunner: the part the decode and prefill graph runners share.

A runner owns a sorted list of bucket sizes; each bucket has StaticInputs padded to its extent.
A step picks a bucket (RunnerPlan), pads the batch to it, copies it into the bucket's buffers and
executes through the backend (a CUDA graph replay, or a plain forward on CPU). The GatherLayout it
returns is padded with the bucket's extent and is made here, by the runner that executes, from the
same extent its buffers (and so its MoE gather) have: "graph runner executed" implies "padded
extent known".
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

import torch

from capture.capturer import GatherLayout
from rollout.batch.forward_batch import ForwardBatch, ForwardOutput
from rollout.batch.kv_pool import KVPool
from rollout.exec.runners.capture_profiler import CaptureTag, GraphCaptureProfiler
from rollout.exec.runners.graph_backend import GraphBackend
from rollout.exec.runners.static_inputs import StaticInputs

if TYPE_CHECKING:
    from rollout.exec.model_runner import RunnerChoice


class StaticShapeRunner:
    name = ""            # GatherLayout.runner, e.g. "decode_graph"
    tag_runner = ""      # capture tag prefix, e.g. "decode"
    size_label = ""      # capture tag size label, e.g. "bs"

    def __init__(self, *, sizes: tuple[int, ...], model: torch.nn.Module, kv_pool: KVPool, device: torch.device,
                 backend: GraphBackend, dp_size: int = 1, capture_buffer: Optional[Any] = None,
                 ep_group: Optional[Any] = None, attention: Optional[Any] = None):
        assert sizes, "a static-shape runner needs at least one bucket"
        self.sizes = tuple(sorted(sizes))
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        self.backend = backend
        self.dp_size = dp_size
        self.capture_buffer = capture_buffer
        self.ep_group = ep_group
        self.attention = attention
        self.inputs = {size: self.make_inputs(size) for size in self.sizes}

    # ---- per-runner shape rules ---------------------------------------------------------------
    def extent(self, size: int) -> int:
        """Tokens per rank in a forward of bucket `size` (its padded extent)."""
        raise NotImplementedError

    def make_inputs(self, size: int) -> StaticInputs:
        raise NotImplementedError

    def pad_chunk(self, batch: Optional[Any]) -> int:
        """Most tokens per padding request."""
        raise NotImplementedError

    # ---- execution ---------------------------------------------------------------------------
    def _batch(self, batch: Optional[Any], size: int, layout: GatherLayout) -> ForwardBatch:
        fb = ForwardBatch.from_scheduled(batch, kv_pool=self.kv_pool, device=self.device, capture=self.capture_buffer,
                                         pad_to=self.extent(size), pad_chunk=self.pad_chunk(batch))
        fb = self.inputs[size].load(fb)
        fb = dataclasses.replace(fb, layout=layout, ep_group=self.ep_group)
        # NOTE: bound after the load, so a backend sees (and a graph reads) only the static buffers
        return fb if self.attention is None else self.attention.bind(fb, static=True)

    def forward(self, batch: Optional[Any], counts: tuple[int, ...], choice: RunnerChoice) -> ForwardOutput:
        assert choice.runner == self.name and choice.size in self.inputs, (choice, self.name, self.sizes)
        extent = self.extent(choice.size)
        assert choice.extent == extent, (choice, extent)
        layout = GatherLayout.padded(self.name, counts, extent=extent)
        fb = self._batch(batch, choice.size, layout)
        logits = self.backend.run(choice.size, fb)
        num = batch.num_logit_rows if batch is not None else 0
        logits = logits[:num].float()
        if self.backend.uses_graphs:
            logits = logits.clone()  # NOTE: the graph's output buffer is overwritten by the next replay
        return ForwardOutput(logits=logits, layout=layout)

    def capture(self, profiler: GraphCaptureProfiler, rank: int) -> None:
        """Captures every bucket, largest first; one profiler trace per capture."""
        for size in sorted(self.sizes, reverse=True):
            layout = GatherLayout.padded(self.name, (0,) * self.dp_size, extent=self.extent(size))
            fb = self._batch(None, size, layout)
            tag = CaptureTag(self.tag_runner, self.size_label, size, rank)
            with profiler.capturing(tag):
                self.backend.capture(size, fb)
