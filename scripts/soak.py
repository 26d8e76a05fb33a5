#!/usr/bin/env python
"""Soak test of the GRPO loop: memory and open files of every process over a long run.

Runs the loop of ``python -m trainer_bridge.train --config configs/train/tiny.yaml`` (the same
``run_async``, in this process, which is therefore the trainer) for ``--steps`` steps, and every
``--every`` steps records each process's RSS and open file descriptors (``/proc/PID/fd``): the
trainer (this process, with its glibc heap in use and free and its Python object count), each
``rollout-serve`` front end and each engine process under it. The run directory is ``runs/soak``
unless ``--set run_dir=...`` says otherwise. The samples go to ``OUT.json`` and ``OUT.csv`` as they
are taken; at the end a table gives RSS at step 1, after ``--base-step`` (100) and at the last step,
the growth, the slope over the second half of the run, and the open files.

The verdict compares windows, not single samples: the mean RSS of the samples in the ``--window``
steps from ``--base-step`` on against the mean of those in the last ``--window`` steps. A sample
lands at any point of a step (an engine mid-decode, or just after it gave its free heap back when it
fell idle), so one sample against another moves by the width of that band (about 8% for the tiny
engines) while the level does not move; the point-to-point growth and the windows' maxima are
printed beside it. The servers are stopped by the loop itself; SIGTERM / SIGINT stop
the loop the same way, and any process of the tree still alive afterwards is killed and named.

    python scripts/soak.py [--steps 1000] [--every 10] [--out runs/soak/soak] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import ctypes
import gc
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")

import psutil  # noqa: E402

from trainer_bridge.train import Hooks, run_async  # noqa: E402
from trainer_bridge.train_config import load_train_config  # noqa: E402

MB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _own_heap() -> dict:
    """This process's (the trainer's) glibc heap in use and free, and its Python objects; {} off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        mi = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"heap_used_mb": round(mi.uordblks / MB, 1), "heap_free_mb": round(mi.fordblks / MB, 1),
            "py_objects": len(gc.get_objects())}


def _role(p: psutil.Process) -> str:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return "gone"
    if "rollout.core.engine_proc" in cmd:
        return "engine"
    if "rollout-serve" in cmd or "rollout.server" in cmd:
        return "server"
    return p.name() or "other"


def _open_files(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


@dataclass
class Tree:
    """Labels for the processes under this one: ``trainer``, ``server0``, ``engine0.0`` (server 0's
    first engine), in order of appearance; a restarted process gets a new label."""
    me: psutil.Process = field(default_factory=psutil.Process)
    labels: dict = field(default_factory=dict)                      # pid -> label

    def label(self, p: psutil.Process, role: str) -> str:
        if p.pid not in self.labels:
            if role == "engine":
                parent = self.labels.get(p.ppid(), "server?").removeprefix("server")
                n = sum(1 for v in self.labels.values() if v.startswith(f"engine{parent}."))
                self.labels[p.pid] = f"engine{parent}.{n}"
            else:
                n = sum(1 for v in self.labels.values() if v.startswith(role))
                self.labels[p.pid] = f"{role}{n}"
        return self.labels[p.pid]

    def sample(self, step: int) -> list[dict]:
        rows = []
        procs = [(self.me, "trainer")]
        # NOTE: parents before children (pid order can wrap), so an engine finds its server's label
        for p in sorted(self.me.children(recursive=True), key=lambda q: _depth(q, self.me.pid)):
            if not _forked_only(p):
                procs.append((p, _role(p)))
        for p, role in procs:
            try:
                rss = p.memory_info().rss
                threads = p.num_threads()
            except psutil.Error:
                continue
            name = "trainer" if p is self.me else self.label(p, role)
            rows.append({"step": step, "t": round(time.time(), 1), "label": name, "role": role, "pid": p.pid,
                         "rss_mb": round(rss / MB, 1), "open_files": _open_files(p.pid), "threads": threads,
                         **(_own_heap() if p is self.me else {})})
        return rows


def _forked_only(p: psutil.Process) -> bool:
    """A fork that has not exec'd yet (a subprocess being started): its parent's copy, not a process
    of its own."""
    try:
        parent = p.parent()
        return parent is not None and p.cmdline() == parent.cmdline()
    except psutil.Error:
        return True


def _depth(p: psutil.Process, root: int) -> int:
    d = 0
    try:
        while p is not None and p.pid != root and d < 32:
            p, d = p.parent(), d + 1
    except psutil.Error:
        pass
    return d


def _at(rows: list[dict], label: str, step: int) -> dict | None:
    """The first sample of `label` at or after `step`."""
    mine = [r for r in rows if r["label"] == label and r["step"] >= step]
    return min(mine, key=lambda r: r["step"]) if mine else None


def _slope(rows: list[dict], label: str, from_step: int) -> float:
    """Least-squares RSS slope, MB per step, of `label`'s samples from `from_step` on."""
    pts = [(r["step"], r["rss_mb"]) for r in rows if r["label"] == label and r["step"] >= from_step]
    if len(pts) < 2:
        return float("nan")
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / var if var else float("nan")


def _window(rows: list[dict], label: str, lo: int, hi: int) -> list[float]:
    """`label`'s RSS samples (MB) of steps lo..hi, both included."""
    return [r["rss_mb"] for r in rows if r["label"] == label and lo <= r["step"] <= hi]


def _pct(new: float, old: float) -> float:
    return 100 * (new - old) / old


def table(rows: list[dict], base_step: int, max_growth_pct: float, window: int = 50) -> tuple[str, bool]:
    """The summary table and whether the mean RSS of every trainer/server/engine over the last
    `window` steps stayed within `max_growth_pct` of its mean over the `window` steps from
    `base_step` on."""
    if window < 1:
        raise ValueError(f"window: must be >= 1 step, got {window}")
    last = max(r["step"] for r in rows)
    base_step = min(base_step, last)   # NOTE: a run shorter than base_step: growth from step 1
    labels = list(dict.fromkeys(r["label"] for r in rows))
    base_hi = min(base_step + window - 1, last)
    end_lo = max(last - window + 1, base_step)
    head = (f"| process | pid | RSS step 1 / {base_step} / {last} (MB) | point to point | "
            f"mean steps {base_step}-{base_hi} / {end_lo}-{last} (MB) | growth of the mean | max growth | "
            f"slope 2nd half (MB/step) | open files step {base_step} -> {last} |")
    out = [head, "|---|---|---|---|---|---|---|---|---|"]
    ok = True
    for lab in labels:
        first, base, end = _at(rows, lab, 0), _at(rows, lab, base_step), _at(rows, lab, last)
        if base is None or end is None or end["step"] != last:
            out.append(f"| {lab} | {first['pid']} | {first['rss_mb']:.0f} | (gone before the end) | | | | | |")
            continue
        # NOTE: a process restarted after base_step has no base window of its own: its first samples are
        base_w = _window(rows, lab, base["step"], max(base_hi, base["step"]))
        end_w = _window(rows, lab, end_lo, last)
        m0, m1 = sum(base_w) / len(base_w), sum(end_w) / len(end_w)
        growth = _pct(m1, m0)
        if first["role"] in ("trainer", "server", "engine") and growth > max_growth_pct:
            ok = False
        slope = _slope(rows, lab, (base["step"] + last) // 2)
        out.append(f"| {lab} | {end['pid']} | {first['rss_mb']:.0f} / {base['rss_mb']:.0f} / {end['rss_mb']:.0f} | "
                   f"{_pct(end['rss_mb'], base['rss_mb']):+.1f}% | {m0:.0f} / {m1:.0f} | {growth:+.1f}% | "
                   f"{_pct(max(end_w), max(base_w)):+.1f}% | {slope:+.3f} | "
                   f"{base['open_files']} -> {end['open_files']} |")
    return "\n".join(out), ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "train" / "tiny.yaml"))
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=10, help="sample every this many steps (and at steps 1 and last)")
    ap.add_argument("--base-step", type=int, default=100, help="growth is measured from this step to the last")
    ap.add_argument("--max-growth-pct", type=float, default=5.0,
                    help="the verdict's bound on the growth of a process's mean RSS")
    ap.add_argument("--window", type=int, default=50,
                    help="steps per window: the first from --base-step on, the last ending at the last step")
    ap.add_argument("--out", default=None, help="OUT.json and OUT.csv (default: RUN_DIR/soak)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a training config override, as for trainer_bridge.train")
    ap.add_argument("--check", action="store_true", help="exit 1 when a process grew more than --max-growth-pct")
    args = ap.parse_args(argv)
    cfg = load_train_config(args.config, ["run_dir=runs/soak", *args.overrides, f"steps={args.steps}",
                                          "progress=false"])
    out = Path(args.out or Path(cfg.run_dir) / "soak")
    out.parent.mkdir(parents=True, exist_ok=True)
    tree = Tree()
    rows: list[dict] = []
    t0 = time.monotonic()

    def record(step: int) -> None:
        rows.extend(tree.sample(step))
        out.with_suffix(".json").write_text(json.dumps({"config": args.config, "overrides": args.overrides,
                                                        "steps": args.steps, "samples": rows}))
        with open(out.with_suffix(".csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            w.writeheader()
            w.writerows(rows)
        now = [r for r in rows if r["step"] == step]
        print(f"[soak] step {step} ({time.monotonic() - t0:.0f}s): "
              + ", ".join(f"{r['label']} {r['rss_mb']:.0f} MB/{r['open_files']} fds" for r in now), flush=True)

    def on_step(step: int, _rec: dict) -> None:
        if step == 1 or step % args.every == 0 or step == args.steps:
            record(step)

    async def soak() -> None:
        # NOTE: SIGTERM and SIGINT cancel the loop's task, so the loop's own cleanup stops the
        # servers; SIGINT too, as a background job started by a script ignores it otherwise
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        await run_async(cfg, hooks=Hooks(on_step=on_step), log=lambda line: print(line, flush=True))

    status = 0
    try:
        asyncio.run(soak())
    except asyncio.CancelledError:
        print("[soak] stopped by a signal; the loop stopped its servers", flush=True)
        status = 130
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()   # NOTE: its service process lives until this (or exit)
    left = [p for p in psutil.Process().children(recursive=True) if p.is_running()]
    for p in left:
        print(f"[soak] still running after the loop: pid {p.pid} {' '.join(p.cmdline())[:120]}; killing it")
        p.kill()
    psutil.wait_procs(left, timeout=10)
    if not rows:
        return status or 1
    text, ok = table(rows, args.base_step, args.max_growth_pct, args.window)
    last = max(r["step"] for r in rows)
    print(f"\n[soak] {last} steps, {time.monotonic() - t0:.0f}s; samples in "
          f"{out.with_suffix('.json')} and .csv\n{text}")
    print(f"[soak] mean RSS of the last {args.window} steps against the {args.window} from step "
          f"{min(args.base_step, last)}: {'within' if ok else 'OVER'} {args.max_growth_pct:g}% for trainer, "
          "servers and engines")
    if status:
        return status
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
