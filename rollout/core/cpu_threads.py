"""CpuThreads: the torch intra-op threads of a CPU engine process, chosen per forward.

While requests stream, the engine sends every step's deltas and the front end (the HTTP server or
the caller's Python API) turns them into chunks while the engine runs its next forward. On a host
without a spare core the two then contend: one of the engine's OpenMP threads is preempted and
the others wait for it at every barrier. Measured on 2 CPUs with 64 streams, one thread beat two
on both the server and the Python API, while a non-streaming GRPO batch (the front end idle
between steps) ran faster with two (docs/benchmarks-history.md, "Server and engine process").

So a forward that follows a step which sent stream deltas runs with `reserve` threads fewer, and
every other forward with all of them. vLLM's CPU backend likewise keeps a core for its front end.
The price: a forward's float results depend on its thread count, so a request's logprobs then
differ in the last bits between streamed and non-streamed runs; `cpu_reserve` is 0 (off) unless
set.
"""
from __future__ import annotations

import torch


class CpuThreads:
    def __init__(self, threads: int, reserve: int):
        self.quiet = threads
        self.busy = max(1, threads - reserve)
        self.steps_front_end_busy = 0   # steps that ran with self.busy because requests streamed
        torch.set_num_threads(self.quiet)

    @property
    def switches(self) -> bool:
        """Whether the threads differ by step (cpu_reserve > 0 and more than one thread)."""
        return self.busy != self.quiet

    def use(self, front_end_busy: bool) -> int:
        """The threads of the next step's forward (EngineCore.use_threads sets them)."""
        self.steps_front_end_busy += front_end_busy
        return self.busy if front_end_busy else self.quiet

    def report(self) -> dict:
        return {"cpu_threads": self.quiet, "cpu_threads_front_end_busy": self.busy,
                "steps_front_end_busy": self.steps_front_end_busy}
