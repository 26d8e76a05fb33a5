"""The static-shape decode/prefill runners (CUDA graphs on GPU, static buffers on CPU), their
graph backends and graph-capture profiling; the eager runner and the plan that picks a runner
are in rollout/exec/model_runner.py."""
from rollout.exec.runners.capture_profiler import CaptureTag, GraphCaptureProfiler
from rollout.exec.runners.decode_graph_runner import DecodeGraphRunner
from rollout.exec.runners.graph_backend import CudaGraphBackend, GraphBackend
from rollout.exec.runners.prefill_graph_runner import PrefillGraphRunner

__all__ = ["CaptureTag", "GraphCaptureProfiler", "DecodeGraphRunner", "CudaGraphBackend", "GraphBackend",
           "PrefillGraphRunner"]
