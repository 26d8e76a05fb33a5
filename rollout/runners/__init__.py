"""Runners: eager, and static-shape decode/prefill runners (CUDA graphs on GPU, static buffers on CPU)."""
from rollout.runners.capture_profiler import CaptureTag, GraphCaptureProfiler, variant_product
from rollout.runners.decode_graph_runner import DecodeGraphRunner
from rollout.runners.eager_runner import EagerRunner
from rollout.runners.graph_backend import CudaGraphBackend, GraphBackend
from rollout.runners.prefill_graph_runner import PrefillGraphRunner
from rollout.runners.runner_plan import DECODE, EAGER, PREFILL, RankShape, RunnerChoice, RunnerPlan

__all__ = ["CaptureTag", "GraphCaptureProfiler", "variant_product", "DecodeGraphRunner", "EagerRunner",
           "CudaGraphBackend", "GraphBackend", "PrefillGraphRunner", "DECODE", "EAGER", "PREFILL", "RankShape",
           "RunnerChoice", "RunnerPlan"]
