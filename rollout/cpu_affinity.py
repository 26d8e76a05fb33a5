"""CPU affinity (cpu_affinity): the CPUs an engine process runs on, and its front end beside it.

pin_process moves every thread of the calling process (keep_off: off the engines' CPUs);
unsettable_cpus checks a request before any process is started. Linux only (sched_setaffinity).
"""
from __future__ import annotations

import os
import threading
from typing import Iterable


def unsettable_cpus(cpus: Iterable[int]) -> list[int]:
    """The CPUs of `cpus` a thread of this process may not be moved to (offline, or outside its
    cpuset: SLURM and containers narrow it), tried on a throwaway thread: the kernel keeps only
    the allowed part of a mask. A mask narrowed by taskset is no limit: a process may widen it."""
    cpus = set(cpus)
    got: set[int] = set()

    def probe() -> None:
        try:
            os.sched_setaffinity(0, cpus)   # NOTE: 0 is the calling thread only (Linux)
            got.update(os.sched_getaffinity(0))
        except OSError:                    # none of them allowed
            pass
    t = threading.Thread(target=probe, name="cpu-affinity-probe")
    t.start()
    t.join()
    return sorted(cpus - got)


def pin_process(cpus: Iterable[int]) -> None:
    """Runs every thread of this process, and every thread it starts later (they inherit the
    mask), on `cpus` only: the threads torch, ZMQ or the runtime started already are moved too."""
    cpus = set(cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:   # a thread that has exited meanwhile
            pass


def keep_off(cpus: Iterable[int]) -> list[int]:
    """Moves this process (pin_process) to the usable CPUs not in `cpus`, the engines' ones, and
    returns them; does nothing and returns [] when `cpus` is empty or takes every usable CPU."""
    rest = sorted(set(os.sched_getaffinity(0)) - set(cpus)) if cpus else []
    if rest:
        pin_process(rest)
    return rest
