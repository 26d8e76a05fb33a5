"""ForwardWorker: the overlap schedule's forward thread, and the ForwardJob it runs.

A step without it is strictly sequential: schedule, build the inputs, forward, sample, process
the outputs, then the next schedule. With it (`enable_overlap_schedule`, SGLang's overlap
scheduler), the engine thread launches step N+1 and then processes step N's results while this
thread runs N+1's forward and sampling: the scheduling, the output processing and the updates
sent to the front end leave the forward's path. Step N+1 is scheduled before N's tokens are on
the host, so a request decoding in both feeds its N-th token unseen: the scheduler marks it
pending, and the forward stage fills it in from N's samples before the forward (SGLang's future
token ids). A request that N's token ends is still fed once more, and that row's results are
dropped; one that N's token certainly ends (max_new_tokens, its length limit) is not scheduled.

On CPU the two threads share the host: torch's operators release the GIL, so the engine
thread's Python runs while the forward computes; this thread also runs every heavy torch call
(the model's load and capture, control calls) with the engine's torch threads, while the engine
thread keeps torch to one (EngineCore). Jobs run one at a time, in the order submitted: every
forward's KV writes and collectives keep the step order.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass(eq=False)
class ForwardJob:
    """One step's forward stage: its inputs (fixed at launch) and, once done, its results."""
    batch: Any                           # Optional[ScheduledBatch]: None on a DP rank with nothing
    shapes: list                         # every rank's RankShape (exchanged at launch)
    plan: Any                            # Optional[SamplePlan]
    threads: int = 0                     # CPU: torch intra-op threads of its forward (0: leave them)
    out: Any = None                      # Optional[ForwardOutput]
    drawn: Optional[list] = None         # the sampled columns read to the host
    error: Optional[BaseException] = None
    done: threading.Event = field(default_factory=threading.Event)

    def run(self, stage: Callable[["ForwardJob"], None]) -> None:
        """Runs the forward stage on this job; its error is kept for wait()."""
        try:
            stage(self)
        except BaseException as exc:  # noqa: BLE001 (re-raised on the engine thread by wait)
            self.error = exc
        finally:
            self.done.set()

    def wait(self) -> None:
        """Until the forward stage ended; re-raises its error."""
        self.done.wait()
        if self.error is not None:
            raise self.error


class ForwardWorker:
    def __init__(self, forward: Callable[[ForwardJob], None], device: torch.device, threads: int = 0):
        """forward: the forward stage, run on this worker's thread with each job in turn. threads:
        CPU: torch intra-op threads of that thread (0: torch's default)."""
        self._forward = forward
        self._tasks: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, args=(device, threads), name="rollout-forward",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: ForwardJob) -> None:
        """Runs job's forward stage after the work already submitted (job.wait() for its end)."""
        self._tasks.put(lambda: self._run(job))

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the forward thread, after the work already submitted: its result, or its error raised."""
        job = ForwardJob(batch=None, shapes=[], plan=None)
        box: list = []
        self._tasks.put(lambda: job.run(lambda _: box.append(fn(*args))))
        job.wait()
        return box[0]

    def _run(self, job: ForwardJob) -> None:
        # NOTE: torch's intra-op thread count is per thread: a step's (CpuThreads) is set here
        if job.threads and torch.get_num_threads() != job.threads:
            torch.set_num_threads(job.threads)
        job.run(self._forward)

    def _loop(self, device: torch.device, threads: int) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)   # NOTE: the current device is per thread
        if threads:
            torch.set_num_threads(threads)
        while True:
            task = self._tasks.get()
            if task is None:
                return
            task()

    def close(self) -> None:
        """Stops the thread after the work already submitted."""
        if self._thread.is_alive():
            self._tasks.put(None)
            self._thread.join()
