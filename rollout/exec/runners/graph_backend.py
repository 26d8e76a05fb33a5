"""GraphBackend: how a static-shape runner executes a bucket (CUDA graphs on GPU, plain calls on CPU).

Both backends see the same static input buffers (StaticInputs); only the execution differs, so the
padding and slicing around them run in CPU CI exactly as on a GPU.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Hashable

import torch

from rollout.batch.forward_batch import ForwardBatch


class GraphMemoryPool:
    """The CUDA graph memory pool every graph of one ModelRunner is captured into (none yet:
    the first capture creates it). Graphs never replay concurrently, so they can share it."""

    def __init__(self) -> None:
        self.handle: Any = None

    def adopt(self, graph: "torch.cuda.CUDAGraph") -> None:
        if self.handle is None:
            self.handle = graph.pool()


class GraphBackend:
    """No graphs: "capture" is a warm-up forward over the static buffers; run is a plain forward."""

    uses_graphs = False
    compiles = False    # CompiledBackend: capture compiles (at startup, on any device)

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def forward(self, key: Hashable, fb: ForwardBatch) -> torch.Tensor:
        """Bucket key's forward: what run calls, and what a CUDA graph captures (CompiledBackend: compiled)."""
        return self.model(fb)

    @torch.inference_mode()
    def capture(self, key: Hashable, fb: ForwardBatch) -> None:
        self.forward(key, fb)

    def run(self, key: Hashable, fb: ForwardBatch) -> torch.Tensor:
        return self.forward(key, fb)


class CudaGraphBackend(GraphBackend):
    """One torch.cuda.CUDAGraph per key, all in the runner's memory pool; capture the largest
    bucket first so the smaller ones reuse its memory."""

    uses_graphs = True
    WARMUP_RUNS = 2

    def __init__(self, model: torch.nn.Module, pool: GraphMemoryPool):
        super().__init__(model)
        self.pool = pool
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self, key: Hashable, fb: ForwardBatch) -> None:
        assert key not in self.graphs, key
        # NOTE: no host syncs inside a graph: the MoE takes a sync-free path (FusedExperts.choose_impl).
        # NOTE: a fresh ForwardBatch per call: what it makes lazily (attn_mask) must be made inside
        # the graph, from the static buffers, not cached from a warm-up run outside it.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.WARMUP_RUNS):
                self.forward(key, dataclasses.replace(fb, graph_safe=True))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool.handle):
            out = self.forward(key, dataclasses.replace(fb, graph_safe=True))
        self.pool.adopt(graph)
        self.graphs[key] = (graph, out)

    def run(self, key: Hashable, fb: ForwardBatch) -> torch.Tensor:
        # NOTE: fb's tensors are the static buffers the graph was captured over (StaticInputs.load
        # just wrote this step's batch into them); the returned logits are the graph's static output.
        graph, out = self.graphs[key]
        graph.replay()
        return out
