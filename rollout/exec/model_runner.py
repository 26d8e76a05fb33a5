"""ModelRunner: picks the runner for each step (with every DP rank) and runs the batch through it.

Per step: this rank's batch shape is exchanged with the other DP ranks (one small all-gather), the
RunnerPlan picks one runner and bucket from all shapes (so every rank agrees), and that runner
executes and returns a ForwardOutput carrying the GatherLayout it used. Capture reads only that.

RunnerPlan is pure: no model, no tensors. All ranks feed it the same exchanged shapes, so they all
pick the same runner and bucket, hence the same GatherLayout. It also knows the largest gathered
forward every runner can produce, which the engine checks against the capture buffer at startup
(invariant 1). EagerRunner runs a batch at its own shape; the static-shape runners (decode and
prefill buckets, CUDA graphs on GPU) live in rollout/exec/runners/.
"""
from __future__ import annotations

import dataclasses
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from capture.buffer_sizing import ForwardShapeLimits, capture_buffer_rows
from capture.capturer import GatherLayout
from rollout.batch.forward_batch import ForwardBatch, ForwardOutput, ScheduledBatch
from rollout.batch.kv_pool import KVPool
from rollout.exec.runners.capture_profiler import GraphCaptureProfiler
from rollout.exec.runners.compiled_backend import CompiledBackend, CompiledCudaGraphBackend
from rollout.exec.runners.decode_graph_runner import DecodeGraphRunner
from rollout.exec.runners.graph_backend import CudaGraphBackend, GraphBackend, GraphMemoryPool
from rollout.exec.runners.piecewise_backend import PiecewiseBackend
from rollout.exec.runners.prefill_graph_runner import PrefillGraphRunner

DECODE = DecodeGraphRunner.name     # "decode_graph"
PREFILL = PrefillGraphRunner.name   # "prefill_graph"
EAGER = "eager"


@dataclass(frozen=True)
class RankShape:
    """What one rank's scheduler issued for a step."""

    num_tokens: int
    batch_size: int
    all_single: bool    # every request adds exactly one token (decode-shaped); True when idle

    @staticmethod
    def of(batch: Optional[ScheduledBatch]) -> "RankShape":
        """batch: None for an idle rank."""
        if batch is None:
            return RankShape(0, 0, True)
        return RankShape(sum(batch.extend_lens), len(batch.extend_lens), all(e == 1 for e in batch.extend_lens))

    def encode(self) -> tuple[int, int, int]:
        return self.num_tokens, self.batch_size, int(self.all_single)

    @staticmethod
    def decode(values: Sequence[int]) -> "RankShape":
        return RankShape(int(values[0]), int(values[1]), bool(values[2]))


@dataclass(frozen=True)
class RunnerChoice:
    runner: str                # DECODE | PREFILL | EAGER
    size: Optional[int]        # the bucket: batch size (decode) or tokens (prefill); None for eager
    extent: Optional[int]      # rows per rank in the gathered MoE input when padded; None = packed


def _smallest_at_least(sizes: tuple[int, ...], n: int) -> Optional[int]:
    for s in sizes:  # sorted ascending
        if s >= n:
            return s
    return None


class RunnerPlan:
    def __init__(self, limits: ForwardShapeLimits):
        self.limits = limits
        self.decode_sizes = tuple(sorted(limits.decode_graph_batch_sizes))
        self.prefill_sizes = tuple(sorted(limits.prefill_graph_token_sizes))

    def choose(self, shapes: Sequence[RankShape]) -> Optional[RunnerChoice]:
        """The runner for a step whose ranks issued `shapes` (rank order); None when no rank has tokens.

        Decode buckets take steps where every rank is decode-shaped (or idle) and the largest batch
        fits; prefill buckets take any step whose largest per-rank token count fits; eager the rest.
        """
        assert len(shapes) == self.limits.dp_size, (shapes, self.limits.dp_size)
        max_tokens = max(s.num_tokens for s in shapes)
        if max_tokens == 0:
            return None
        if self.decode_sizes and all(s.all_single for s in shapes):
            size = _smallest_at_least(self.decode_sizes, max(s.batch_size for s in shapes))
            if size is not None:
                return RunnerChoice(DECODE, size, size)
        size = _smallest_at_least(self.prefill_sizes, max_tokens)
        if size is not None:
            return RunnerChoice(PREFILL, size, size)
        return RunnerChoice(EAGER, None, None)

    @staticmethod
    def layout(choice: RunnerChoice, shapes: Sequence[RankShape]) -> GatherLayout:
        counts = tuple(s.num_tokens for s in shapes)
        if choice.extent is None:
            return GatherLayout.packed(choice.runner, counts)
        return GatherLayout.padded(choice.runner, counts, extent=choice.extent)

    def max_gathered_rows(self) -> dict[str, int]:
        """The most rows each runner can put in the gathered MoE input (all ranks together)."""
        lim = self.limits
        rows = {EAGER: lim.dp_size * max(lim.chunked_prefill_tokens, lim.max_decode_tokens)}
        if self.decode_sizes:
            rows[DECODE] = lim.dp_size * self.decode_sizes[-1]
        if self.prefill_sizes:
            rows[PREFILL] = lim.dp_size * self.prefill_sizes[-1]
        return rows

    def check_capture_fits(self, buffer_rows: int, max_rows: Optional[int] = None) -> None:
        """Startup check (invariant 1): every forward any runner can issue fits the capture buffer,
        and the buffer fits max_rows when one is configured. ValueError naming the values if not."""
        need = self.max_gathered_rows()
        worst = max(need.values())
        sized = capture_buffer_rows(self.limits)
        if worst > buffer_rows or (max_rows is not None and sized > max_rows):
            lim = self.limits
            detail = ", ".join(f"{k} {v}" for k, v in sorted(need.items()))
            limit = (f"the capture buffer has {buffer_rows} rows" if worst > buffer_rows
                     else f"max_capture_buffer_rows={max_rows}")
            raise ValueError(
                f"routed-expert capture buffer cannot hold every forward this config can issue: "
                f"it needs {max(worst, sized)} rows = dp_size={lim.dp_size} x max(decode_graph_batch_sizes max "
                f"{max(self.decode_sizes, default=0)}, "
                f"prefill_graph_token_sizes max {max(self.prefill_sizes, default=0)}, chunked prefill tokens "
                f"per rank {lim.chunked_prefill_tokens} (chunked_prefill_size), max_running_requests="
                f"{lim.max_running_requests} x verified tokens per request {lim.verify_tokens_per_request} "
                f"(speculative_num_draft_tokens)) [gathered rows per runner: {detail}], "
                f"but {limit}; lower one of these values or raise max_capture_buffer_rows")


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

    def forward(self, batch: Optional[ScheduledBatch], counts: tuple[int, ...],
                choice: Optional[RunnerChoice] = None, all_logits: bool = False) -> ForwardOutput:
        """batch: this rank's ScheduledBatch, or None (idle: an empty forward that joins the collectives).
        all_logits: also return every token's logits (token rows request-major, no padding)."""
        layout = GatherLayout.packed(self.name, counts)
        fb = ForwardBatch.from_scheduled(batch, kv_pool=self.kv_pool, device=self.device,
                                         capture=self.capture_buffer, segment_attention=True)
        fb = dataclasses.replace(fb, layout=layout, ep_group=self.ep_group)
        if self.attention is not None:
            fb = self.attention.bind(fb, static=False)
        if all_logits:
            full = self.model(fb, return_all_logits=True).float()               # [N, vocab]
            return ForwardOutput(logits=full[fb.logits_indices], layout=layout, token_logits=full)
        logits = self.model(fb)
        return ForwardOutput(logits=logits.float(), layout=layout)


class ModelRunner:
    def __init__(self, *, model: torch.nn.Module, kv_pool: KVPool, device: torch.device,
                 limits: Optional[ForwardShapeLimits] = None, capture_buffer: Optional[Any] = None,
                 seq_capacity: Optional[int] = None, ep_group: Optional[Any] = None,
                 use_cuda_graphs: Optional[bool] = None, static_grid: Optional[bool] = None,
                 attention_backend: Optional[Any] = None, torch_compile_max_bs: Optional[int] = None):
        """limits: the same ForwardShapeLimits the capture buffer is sized from (None: eager only).
        attention_backend: bound into every forward of every runner (models/attention_backend.py;
        None: torch).

        use_cuda_graphs: default on for a CUDA device. static_grid: keep the decode attention grid
        at seq_capacity keys (default: only with CUDA graphs, which need it). torch_compile_max_bs:
        the decode buckets up to it run a torch.compile'd forward (runners/compiled_backend.py;
        with CUDA graphs, captured over it; None: none is compiled).
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
            compile_keys = tuple(s for s in limits.decode_graph_batch_sizes
                                 if torch_compile_max_bs is not None and s <= torch_compile_max_bs)
            if compile_keys:
                backend = (CompiledCudaGraphBackend(model, compile_keys, self.graph_pool) if use_cuda_graphs
                           else CompiledBackend(model, compile_keys))
            else:
                backend = CudaGraphBackend(model, self.graph_pool) if use_cuda_graphs else GraphBackend(model)
            self.runners[DECODE] = DecodeGraphRunner(
                sizes=limits.decode_graph_batch_sizes, backend=backend, dp_size=limits.dp_size,
                seq_capacity=seq_capacity if static_grid else None, **common)
        if limits.prefill_graph_token_sizes:
            backend = PiecewiseBackend(model, max_tokens=max(limits.prefill_graph_token_sizes), device=device,
                                       use_graphs=use_cuda_graphs, pool=self.graph_pool)
            self.runners[PREFILL] = PrefillGraphRunner(
                sizes=limits.prefill_graph_token_sizes, backend=backend, dp_size=limits.dp_size, **common)
        self.counts: Counter = Counter()
        self.recent_layouts: deque[GatherLayout] = deque(maxlen=512)

    def capture(self, profiler: Optional[GraphCaptureProfiler] = None) -> None:
        """Captures every static runner's buckets: CUDA graphs on GPU; compiled buckets
        (torch.compile) anywhere; on CPU otherwise only with a profiler (then each capture is a
        warm-up forward of that bucket's static buffers)."""
        profiler = profiler or GraphCaptureProfiler(None)
        # NOTE: prefill buckets (hundreds of tokens) first: smaller graphs reuse their pool memory
        for name in (PREFILL, DECODE):
            runner = self.runners.get(name)
            if runner is not None and (runner.backend.uses_graphs or getattr(runner.backend, "compiles", False)
                                       or profiler.enabled):
                runner.capture(profiler, self.dp_rank)

    def report(self) -> dict:
        """Per static runner: whether it replays CUDA graphs, how many it captured per key, forwards
        run; compiled buckets: seconds each took to compile and graphs inductor made for each."""
        out: dict = {}
        for name, runner in self.runners.items():
            backend = getattr(runner, "backend", None)
            graphs = getattr(backend, "graphs", {})
            out[name] = {"uses_graphs": bool(getattr(backend, "uses_graphs", False)),
                         "graphs": {str(k): len(v) if isinstance(v, list) else 1 for k, v in graphs.items()},
                         "forwards": self.counts[name]}
            if getattr(backend, "compiles", False):
                out[name]["compile_seconds"] = {str(k): round(v, 3) for k, v in backend.compile_seconds.items()}
                out[name]["compiled_graphs"] = {str(k): v for k, v in backend.compiled_graphs.items()}
        return out

    def rank_shapes(self, batch: Optional[ScheduledBatch]) -> list[RankShape]:
        """Every rank's shape of this step, in rank order (DP: an exchange over the host-value group)."""
        shape = RankShape.of(batch)
        if self.ep_group is None:
            return [shape]
        return [RankShape.decode(v) for v in self.ep_group.exchange(shape.encode())]

    @torch.inference_mode()
    def forward(self, batch: Optional[ScheduledBatch],
                shapes: Optional[list[RankShape]] = None) -> Optional[ForwardOutput]:
        """batch None: this rank has nothing (DP: it still takes part). None when no rank has tokens.
        shapes: rank_shapes(batch), when the caller exchanged them already (the overlap schedule
        exchanges them on the scheduling thread, so that only forwards use the forward's groups)."""
        if shapes is None:
            shapes = self.rank_shapes(batch)
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
