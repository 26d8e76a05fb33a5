"""Host memory of a long-running CPU engine: oneDNN's shape-keyed kernel caches stay bounded, the
engine loop gives free heap pages back when it falls idle, and large buffers are zeroed without
being written (scripts/soak.py measures the whole GRPO loop; these guard the mechanisms cheaply)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout.core import engine_proc
from rollout.core.engine_proc import EngineLoop
from rollout.host_malloc import ONEDNN_CACHE_VARIABLES, bound_onednn_caches, zero_lazily
from rollout.ipc.messages import Shutdown

ROOT = Path(__file__).resolve().parent.parent

# bfloat16 matmuls of 300 row counts, twice: each new shape is a new oneDNN kernel in both caches
_SHAPES_SCRIPT = r"""
import ctypes, json, sys
import torch
from rollout.host_malloc import bound_onednn_caches
entries = int(sys.argv[1])
if entries:
    bound_onednn_caches(entries)
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MI
torch.set_num_threads(1)
w = torch.randn(256, 128, dtype=torch.bfloat16)
x = torch.randn(301, 128, dtype=torch.bfloat16)
torch.nn.functional.linear(x[:1], w)
used = [libc.mallinfo2().uordblks]
for _ in range(2):
    for m in range(2, 302):
        torch.nn.functional.linear(x[:m], w)
    used.append(libc.mallinfo2().uordblks)
print(json.dumps({"first": used[1] - used[0], "second": used[2] - used[1]}))
"""


def _heap_growth(entries: int, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _SHAPES_SCRIPT, str(entries)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_onednn_kernel_caches_are_bounded_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    unbounded = _heap_growth(0, env)        # torch's defaults: 1024 entries per cache
    if unbounded["first"] < 8 * 2**20:
        pytest.skip(f"bfloat16 matmuls do not cache oneDNN kernels here ({unbounded['first']} bytes for 300 shapes)")
    bounded = _heap_growth(16, env)
    assert bounded["first"] < unbounded["first"] / 4, (bounded, unbounded)
    # NOTE: a full cache replaces kernels without growing (the second pass compiles all 300 again)
    assert abs(bounded["second"]) < 2 * 2**20, bounded


def test_bound_onednn_caches_leaves_values_the_environment_sets(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "1024")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert bound_onednn_caches(32) == {"LRU_CACHE_CAPACITY": "1024", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "32"}
    with pytest.raises(AssertionError):
        bound_onednn_caches(0)   # NOTE: 0 crashes torch's cache


class _Core:
    """What EngineLoop touches of an EngineCore: `work` steps to do, then idle."""

    def __init__(self, work: int):
        self.device = torch.device("cpu")
        self.cpu_threads = None
        self.work = work

    def has_work(self) -> bool:
        return self.work > 0

    def step(self) -> None:
        self.work -= 1

    def take_updates(self) -> list:
        return []


class _Endpoint:
    """Idle iterations until `idle` receives have passed with no work, then Shutdown; `feed` adds
    work to the core at the receives named."""

    def __init__(self, core: _Core, total: int, feed: dict[int, int]):
        self.core, self.total, self.feed, self.n = core, total, feed, 0

    def recv(self, timeout: float) -> list:
        self.n += 1
        self.core.work += self.feed.get(self.n, 0)
        return [Shutdown()] if self.n >= self.total else []

    def send(self, msg) -> None:
        pass


def test_engine_loop_trims_the_heap_once_per_idle_spell(monkeypatch):
    trims: list[int] = []
    core = _Core(work=3)
    endpoint = _Endpoint(core, total=40, feed={10: 2, 20: 2})
    loop = EngineLoop(core, endpoint)
    monkeypatch.setattr(engine_proc, "trim_heap", lambda: trims.append(loop.steps) or True)
    loop.IDLE_TRIM_INTERVAL_S = 0.0
    loop.run()
    # idle after 3 steps (one trim, not one per idle iteration), work at receive 10, idle, work at
    # 20, idle again: a trim after each spell of steps, none while idle without steps
    assert trims == [3, 5, 7]

    trims.clear()
    core = _Core(work=3)
    loop = EngineLoop(core, _Endpoint(core, total=40, feed={10: 2, 20: 2}))
    loop.IDLE_TRIM_INTERVAL_S = 3600.0
    loop.run()
    assert trims == [3], "rate-limited: at most one trim per interval"

    trims.clear()
    core = _Core(work=3)
    core.device = torch.device("meta")   # NOTE: any device other than the CPU: no trim
    EngineLoop(core, _Endpoint(core, total=20, feed={})).run()
    assert trims == []


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="Linux's /proc/self/maps and statm")
def test_zero_lazily_gives_written_pages_back_and_keeps_the_bytes_around_it():
    """A resident buffer of garbage, viewed at an offset that is no page boundary: every byte of
    the view reads zero afterwards, the bytes before and after it keep their values, and most of
    its pages left the process's resident memory (they were dropped, not written)."""
    page = os.sysconf("SC_PAGE_SIZE")
    n = 64 * 2**20 // 4
    base = torch.full((n + 8,), 7.0)
    view = base[3:n + 5]
    before = _resident_bytes()
    assert zero_lazily(view) is view
    dropped = before - _resident_bytes()
    assert bool((view == 0).all())
    assert base[:3].tolist() == [7.0] * 3 and base[n + 5:].tolist() == [7.0] * 3
    assert dropped > (n * 4 - 2 * page) // 2, dropped


def test_zero_lazily_writes_zeros_where_dropping_pages_would_not_zero_them():
    """Shared memory (its dropped pages would read back the shared contents), a strided view and a
    buffer smaller than a page are zeroed by writing; each reads zero after."""
    shared = torch.full((2**20,), 3.0).share_memory_()
    pairs = torch.full((2**20, 2), 5.0)
    small = torch.full((7,), 1.0)
    for t in (shared, pairs[:, 0], small):
        assert bool((zero_lazily(t) == 0).all())
    assert bool((pairs[:, 1] == 5.0).all())
