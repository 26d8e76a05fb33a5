#!/usr/bin/env python
"""Host-side paths a step runs outside the model's forward, for one or more source trees side by side.

    python scripts/bench_host_paths.py [--tree base=/path/to/old/checkout] [--tree this=.] [--rounds 3] [--json PATH]

sampler: ``rollout.exec.sampler.sample`` on a batch of 64 rows of a real vocabulary's width
(151,936, Qwen's) in float32, per setting: plain temperature 1, top-k 50, top-p 0.9 (temperature
0.7), greedy, and half greedy beside half top-k 50. scheduler: the prefill steps that admit GRPO
groups (G prompts x N samples of L tokens; the first of a group computes the prompt, the others
find it in the prefix cache a step later) until none waits, ``Scheduler.schedule`` and
``cache_unfinished`` only. Each tree runs in its own subprocess (PYTHONPATH = that tree, 1
thread), rounds alternating between trees; medians over rounds. Only the public Scheduler / Req /
sample API is used, so any tree with those runs.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 151_936
SAMPLER_CASES = {"temperature 1": [dict(temperature=1.0)] * 64, "top-k 50": [dict(temperature=1.0, top_k=50)] * 64,
                 "top-p 0.9": [dict(temperature=0.7, top_p=0.9)] * 64, "greedy": [dict(temperature=0.0)] * 64,
                 "half greedy, half top-k 50": [dict(temperature=0.0), dict(temperature=1.0, top_k=50)] * 32}
SCHEDULER_CASES = {"64 x 8 of 256 tokens": (64, 8, 256), "16 x 16 of 2,048 tokens": (16, 16, 2048)}


def worker(repeats: int) -> dict:
    import torch

    from rollout.batch.kv_pool import KVPool
    from rollout.core.radix_cache import RadixCache
    from rollout.core.request import Req
    from rollout.core.scheduler import Scheduler
    from rollout.exec.sampler import sample
    from rollout.sampling_params import SamplingParams

    torch.set_num_threads(1)
    out = {}
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    for name, kws in SAMPLER_CASES.items():
        params = [SamplingParams(**kw) for kw in kws]
        args = (logits, params, list(range(64)), [5] * 64, [[]] * 64, None, [0] * 64)
        sample(*args)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sample(*args)
            times.append(time.perf_counter() - t0)
        out[f"sampler: {name}"] = 1e3 * statistics.median(times)
    for name, (groups, n, length) in SCHEDULER_CASES.items():
        rng = random.Random(0)
        pool = KVPool(num_slots=groups * n * (length + 8) + 1024, num_layers=1, num_kv_heads=1, head_dim=2,
                      dtype=torch.float32)
        sched = Scheduler(kv_pool=pool, cache=RadixCache(pool, enabled=True), max_running_requests=groups * n,
                          prefill_token_budget=16384, context_length=length + 64)
        uid = 0
        for _ in range(groups):
            prompt = [rng.randrange(3, 30000) for _ in range(length)]
            for _ in range(n):
                sched.add(Req(uid=uid, rid=str(uid), prompt_ids=list(prompt),
                              params=SamplingParams(max_new_tokens=4), seed=uid))
                uid += 1
        t0 = time.perf_counter()
        while sched.waiting:
            batch = sched.schedule()
            for req in batch.reqs:
                sched.cache_unfinished(req)
        out[f"scheduler: {name}"] = 1e3 * (time.perf_counter() - t0)
    return out


def print_side_by_side(runs: dict[str, list[dict]], names: list[str], what: str, column: str, value: str,
                       ratio: str) -> dict[str, dict[str, float]]:
    """Prints a markdown table of each case's median per tree (runs: tree name -> its rounds, each a
    case -> value dict), and each later tree's ratio to the first; returns the medians."""
    cases = list(runs[names[0]][0])
    table = {name: {c: statistics.median(r[c] for r in runs[name]) for c in cases} for name in names}
    first = names[0]
    print(f"| {what} | " + " | ".join(column.format(name) for name in names)
          + "".join(f" | {name} / {first}" for name in names[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(names) - 1))
    for c in cases:
        print(f"| {c} | " + " | ".join(value.format(table[name][c]) for name in names)
              + "".join(" | " + ratio.format(table[name][c] / table[first][c]) for name in names[1:]) + " |")
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH of a source tree (default: this=.)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="sampler calls timed per round (median)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.repeats)))
        return 0
    if args.rounds < 1 or args.repeats < 1:
        raise SystemExit("--rounds and --repeats must be >= 1")
    trees = [t.split("=", 1) for t in (args.tree or [f"this={REPO}"])]
    results: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for _ in range(args.rounds):
        for name, path in trees:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(path), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--repeats", str(args.repeats)],
                                 env=env, cwd=os.path.abspath(path), capture_output=True, text=True, check=True)
            results[name].append(json.loads(run.stdout.strip().splitlines()[-1]))
    table = print_side_by_side(results, [name for name, _ in trees], "path", "{} (ms)", "{:.1f}", "{:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "medians_ms": table, "runs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
