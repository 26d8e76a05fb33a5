"""CompiledBackend: the decode buckets up to `torch_compile_max_bs` run a torch.compile'd forward
(inductor: C++/OpenMP kernels on CPU, Triton kernels on CUDA), one specialization per bucket
(dynamic=False), compiled when the runner captures (engine startup); larger buckets run the plain
forward. On CUDA with CUDA graphs (CompiledCudaGraphBackend) every bucket replays a graph, and a
compiled bucket's graph holds its compiled kernels.

The compiled function is the model's own forward over a ForwardBatch that carries an OpaqueStep
(rollout/models/opaque_step.py): attention (KV write and core) and each MoE layer (router,
routed-expert capture, experts) run as opaque custom ops whose implementation is the eager code
on the step's real batch, so the traced graph holds only the bucket's static shapes (the step's
attention grid stays out of it) and the MoE layers' host syncs never break it. It is compiled
with fullgraph=True: a graph break is an error at startup, not a silent slow path. The routing
itself (router linear, softmax, top-k, capture) runs inside the MoE op exactly as eager, on the
compiled graph's hidden states; what inductor changes is the rounding of the fused token-wise
ops around it (norms, RoPE, SwiGLU, residual adds).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Hashable

import torch

from rollout.batch.forward_batch import ForwardBatch
from rollout.exec.runners.graph_backend import CudaGraphBackend, GraphBackend, GraphMemoryPool
from rollout.models.opaque_step import OpaqueStep


class CompiledBackend(GraphBackend):
    """compile_keys: the bucket sizes that run compiled (the others run as GraphBackend's)."""

    compiles = True

    def __init__(self, model: torch.nn.Module, compile_keys: tuple[int, ...]):
        super().__init__(model)
        self.compile_keys = tuple(sorted(compile_keys))
        self.compile_seconds: dict[Hashable, float] = {}
        self.compiled_graphs: dict[Hashable, int] = {}   # key -> graphs inductor compiled for it (1: no break)
        self._compiling: Hashable | None = None
        # NOTE: one compiled callable for every bucket: dynamo keeps one specialization per input
        # shape (dynamic=False), so each bucket is its own graph and its own cache entry
        self._compiled = torch.compile(self._forward, backend=self._inductor, dynamic=False, fullgraph=True)

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb)

    def _inductor(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        from torch._inductor.compile_fx import compile_fx  # noqa: PLC0415  (inductor only when compiling)

        key = self._compiling
        if key is None:
            raise RuntimeError("a compiled decode bucket was recompiled while running (a guard on its input "
                               "failed): the forward's inputs must have the bucket's static shapes")
        self.compiled_graphs[key] = self.compiled_graphs.get(key, 0) + 1
        return compile_fx(gm, example_inputs)

    def compiled(self, key: Hashable) -> bool:
        return key in self.compile_keys

    def forward(self, key: Hashable, fb: ForwardBatch) -> torch.Tensor:
        """Bucket key's compiled forward (compiled by its first call: the capture at startup, or
        the first step of a runner that was not captured); the plain forward above the compiled sizes."""
        if not self.compiled(key):
            return super().forward(key, fb)
        if key not in self.compile_seconds:
            return self._compile(key, fb)
        return self._run_compiled(fb)

    def _compile(self, key: Hashable, fb: ForwardBatch) -> torch.Tensor:
        start = time.perf_counter()
        self._compiling = key
        try:
            # NOTE: every bucket is one more specialization of the same function: allow them all
            with torch._dynamo.config.patch(recompile_limit=max(8, 2 * len(self.compile_keys) + 8)):
                out = self._run_compiled(fb)
        finally:
            self._compiling = None
        self.compile_seconds[key] = time.perf_counter() - start
        return out

    def _run_compiled(self, fb: ForwardBatch) -> torch.Tensor:
        return self._compiled(dataclasses.replace(fb, opaque=OpaqueStep(self.model, fb)))


class CompiledCudaGraphBackend(CudaGraphBackend):
    """CUDA: every bucket replays a CUDA graph (CudaGraphBackend's capture and run), and a compiled
    bucket's graph is captured over its compiled forward, as SGLang captures its compiled model:
    the first warm-up run compiles (inductor's Triton kernels), the capture records those kernels
    and the opaque ops' eager kernels (graph-safe: the MoE takes its sync-free path)."""

    compiles = True

    def __init__(self, model: torch.nn.Module, compile_keys: tuple[int, ...], pool: GraphMemoryPool):
        super().__init__(model, pool)
        self.compiler = CompiledBackend(model, compile_keys)
        self.compile_keys = self.compiler.compile_keys
        self.compile_seconds = self.compiler.compile_seconds       # (the compiler's own records)
        self.compiled_graphs = self.compiler.compiled_graphs

    def forward(self, key: Hashable, fb: ForwardBatch) -> torch.Tensor:
        return self.compiler.forward(key, fb)
