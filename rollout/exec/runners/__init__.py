"""Runners: eager, and static-shape decode/prefill runners (CUDA graphs on GPU, static buffers on CPU)."""
from rollout.exec.runners.capture_profiler import CaptureTag, GraphCaptureProfiler, variant_product
from rollout.exec.runners.decode_graph_runner import DecodeGraphRunner
from rollout.exec.runners.eager_runner import EagerRunner
from rollout.exec.runners.graph_backend import CudaGraphBackend, GraphBackend
from rollout.exec.runners.prefill_graph_runner import PrefillGraphRunner
from rollout.exec.runners.runner_plan import DECODE, EAGER, PREFILL, RankShape, RunnerChoice, RunnerPlan

__all__ = ["CaptureTag", "GraphCaptureProfiler", "variant_product", "DecodeGraphRunner", "EagerRunner",
           "CudaGraphBackend", "GraphBackend", "PrefillGraphRunner", "DECODE", "EAGER", "PREFILL", "RankShape",
           "RunnerChoice", "RunnerPlan"]
