"""ModelRunner: picks the runner for each step (with every DP rank) and runs the batch through it.

Per step: this rank's batch shape is exchanged with the other DP ranks (one small all-gather), the
RunnerPlan picks one runner and bucket from all shapes (so every rank agrees), and that runner
executes and returns a ForwardOutput carrying the GatherLayout it used. Capture reads only that.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Any, Optional

import torch

from capture.buffer_sizing import ForwardShapeLimits
from capture.capturer import GatherLayout
from rollout.exec.forward_output import ForwardOutput
from rollout.batch.kv_pool import KVPool
from rollout.exec.runners.capture_profiler import GraphCaptureProfiler, Variant, variant_product
from rollout.exec.runners.decode_graph_runner import DecodeGraphRunner
from rollout.exec.runners.eager_runner import EagerRunner
from rollout.exec.runners.graph_backend import CudaGraphBackend, GraphBackend, GraphMemoryPool
from rollout.exec.runners.piecewise_backend import PiecewiseBackend
from rollout.exec.runners.prefill_graph_runner import PrefillGraphRunner
from rollout.exec.runners.runner_plan import DECODE, EAGER, PREFILL, RankShape, RunnerChoice, RunnerPlan
from rollout.exec.scheduled_batch import ScheduledBatch


class ModelRunner:
    def __init__(self, *, model: torch.nn.Module, kv_pool: KVPool, device: torch.device,
                 limits: Optional[ForwardShapeLimits] = None, capture_buffer: Optional[Any] = None,
                 seq_capacity: Optional[int] = None, ep_group: Optional[Any] = None,
                 variant_axes: tuple[tuple[str, tuple[str, ...]], ...] = (),
                 use_cuda_graphs: Optional[bool] = None, static_grid: Optional[bool] = None,
                 attention_backend: Optional[Any] = None):
        """limits: the same ForwardShapeLimits the capture buffer is sized from (None: eager only).
        attention_backend: bound into every forward of every runner (models/attention_backend.py;
        None: torch).

        use_cuda_graphs: default on for a CUDA device. static_grid: keep the decode attention grid
        at seq_capacity keys (default: only with CUDA graphs, which need it).
        """
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        self.capture_buffer = capture_buffer
        self.ep_group = ep_group
        if limits is None:
            limits = ForwardShapeLimits(dp_size=1, max_running_requests=1, chunked_prefill_tokens=1)
        assert (ep_group.size if ep_group is not None else 1) == limits.dp_size, (ep_group, limits)
        self.limits = limits
        self.plan = RunnerPlan(limits)
        self.dp_rank = ep_group.rank if ep_group is not None else 0
        if use_cuda_graphs is None:
            use_cuda_graphs = device.type == "cuda"
        if static_grid is None:
            static_grid = use_cuda_graphs
        if static_grid and seq_capacity is None:
            raise ValueError("a static attention grid needs seq_capacity (the context length)")
        self.graph_pool = GraphMemoryPool()  # every CUDA graph of this runner (decode and prefill)
        common = dict(model=model, kv_pool=kv_pool, device=device, capture_buffer=capture_buffer, ep_group=ep_group,
                      attention=attention_backend)
        self.runners: dict[str, Any] = {EAGER: EagerRunner(**common)}
        if limits.decode_graph_batch_sizes:
            backend = CudaGraphBackend(model, self.graph_pool) if use_cuda_graphs else GraphBackend(model)
            self.runners[DECODE] = DecodeGraphRunner(
                sizes=limits.decode_graph_batch_sizes, backend=backend, dp_size=limits.dp_size,
                tokens_per_step=limits.tokens_per_decode_step,
                seq_capacity=seq_capacity if static_grid else None, **common)
        if limits.prefill_graph_token_sizes:
            backend = PiecewiseBackend(model, max_tokens=max(limits.prefill_graph_token_sizes), device=device,
                                       use_graphs=use_cuda_graphs, pool=self.graph_pool)
            self.runners[PREFILL] = PrefillGraphRunner(
                sizes=limits.prefill_graph_token_sizes, backend=backend, dp_size=limits.dp_size, **common)
        self.variants: list[Variant] = variant_product(variant_axes)
        self.counts: Counter = Counter()
        self.recent_layouts: deque[GatherLayout] = deque(maxlen=512)

    def capture(self, profiler: Optional[GraphCaptureProfiler] = None) -> None:
        """Captures every static runner's buckets (x every variant): CUDA graphs on GPU; on CPU only
        with a profiler (then each capture is a warm-up forward of that bucket's static buffers)."""
        profiler = profiler or GraphCaptureProfiler(None)
        # NOTE: prefill buckets (hundreds of tokens) first: smaller graphs reuse their pool memory
        for name in (PREFILL, DECODE):
            runner = self.runners.get(name)
            if runner is not None and (runner.backend.uses_graphs or profiler.enabled):
                runner.capture(profiler, self.variants, self.dp_rank)
                runner.active_variant = self.variants[0]

    def report(self) -> dict:
        """Per static runner: whether it replays CUDA graphs, how many it captured per key, forwards run."""
        out: dict = {}
        for name, runner in self.runners.items():
            graphs = getattr(runner.backend, "graphs", {}) if hasattr(runner, "backend") else {}
            out[name] = {"uses_graphs": bool(getattr(getattr(runner, "backend", None), "uses_graphs", False)),
                         "graphs": {str(k): len(v) if isinstance(v, list) else 1 for k, v in graphs.items()},
                         "forwards": self.counts[name]}
        return out

    @torch.inference_mode()
    def forward(self, batch: Optional[ScheduledBatch]) -> Optional[ForwardOutput]:
        """batch None: this rank has nothing (DP: it still takes part). None when no rank has tokens."""
        shape = RankShape.of(batch)
        if self.ep_group is not None:
            shapes = [RankShape.decode(v) for v in self.ep_group.exchange(shape.encode())]
        else:
            shapes = [shape]
        counts = tuple(s.num_tokens for s in shapes)
        if batch is not None and batch.is_prefill and any(r.needs_prompt_logprobs for r in batch.reqs):
            # NOTE: prompt logprobs need every token's logits: eager (one rank only; refused under DP)
            assert self.ep_group is None
            out = self.runners[EAGER].forward(batch, counts, RunnerChoice(EAGER, None, None), all_logits=True)
            self.counts[EAGER] += 1
            self.recent_layouts.append(out.layout)
            return out
        choice = self.plan.choose(shapes)
        if choice is None:
            return None
        out = self.runners[choice.runner].forward(batch, counts, choice)
        assert out.layout.runner == choice.runner and out.layout.padded_extent == choice.extent, (out.layout, choice)
        self.counts[choice.runner] += 1
        self.recent_layouts.append(out.layout)
        return out
