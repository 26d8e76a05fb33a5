"""DP attention and static-shape runner benchmark on an RL-shaped workload (capture on).

Workload: P prompts of 32-128 tokens, n samples each, per-sample max_new_tokens drawn from
[min_new, max_new], ignore_eos, return_logprob and return_routed_experts. Each configuration
(dp_size x runner: eager only, or static-shape runners with eager for what no bucket fits) runs the
same requests `repeats` times, interleaved across configurations, each run on a freshly started
engine (one alive at a time); it reports output tokens/s of the median run, the forwards each
runner executed and the expert weights each rank holds.

With --nnodes N each configuration also runs as one server spanning N nodes on this machine
(loopback: this process is node 0, `rollout-serve --node-rank R` subprocesses the others), side
by side with the same dp_size on one node: the cost of the ranks' collectives and the front end's
messages crossing TCP instead of loopback-local IPC.

  python scripts/bench_dp.py                      # dp 1 and 2, eager and static runners
  python scripts/bench_dp.py --dp-sizes 1 --json out.json
  python scripts/bench_dp.py --nnodes 2 --dp-sizes 2,4 --json nodes.json   # one node vs two nodes
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout import Rollout  # noqa: E402
from rollout.config import DEFAULT_MODEL_PATH, EngineConfig  # noqa: E402
from rollout.config.engine_cli import engine_flags  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# SGLang-style buckets: every batch size up to 8, then steps of 8 (padding costs compute on CPU)
STATIC = dict(decode_graph_batch_sizes=(1, 2, 3, 4, 5, 6, 7, 8) + tuple(range(16, 129, 8)),
              prefill_graph_token_sizes=(64, 128, 256, 384, 512))


def workload(num_prompts: int, n: int, min_new: int, max_new: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    input_ids, params = [], []
    for _ in range(num_prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(32, 128))]
        for k in range(n):
            input_ids.append(prompt)
            params.append({"temperature": 1.0, "max_new_tokens": rng.randint(min_new, max_new), "ignore_eos": True,
                           "sampling_seed": 1000 + len(params)})
    return input_ids, params


class Engine:
    """A Rollout with dp_size ranks on `nnodes` nodes of this machine: this process is node 0, each
    other node a `rollout-serve --node-rank R` subprocess meeting it at a free loopback port."""

    def __init__(self, model_path: str, dp_size: int, static: bool, nnodes: int = 1):
        kw = dict(STATIC) if static else {}
        dist = {}
        if nnodes > 1:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                dist = dict(nnodes=nnodes, dist_init_addr=f"127.0.0.1:{s.getsockname()[1]}")
        # NOTE: the nodes share this machine's CPUs: each rank gets its one-node share of threads
        # (a node would otherwise give its ranks all the CPUs, and OpenMP teams oversubscribed wait)
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        cfg = EngineConfig(model_path=model_path, enable_return_routed_experts=True, dp_size=dp_size,
                           chunked_prefill_size=512, max_running_requests=128, max_total_tokens=32768,
                           cpu_threads=max(1, usable // dp_size), **dist, **kw)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        t0 = time.perf_counter()
        self.nodes = [subprocess.Popen([sys.executable, "-m", "rollout.server", "--log-level", "warning",
                                        *engine_flags(cfg.replace(node_rank=r))], env=env)
                      for r in range(1, nnodes)]
        try:
            self.rollout = Rollout(config=cfg)
        except BaseException:
            self._stop_nodes()
            raise
        self.startup_s = time.perf_counter() - t0

    def _stop_nodes(self) -> None:
        for p in self.nodes:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def shutdown(self) -> None:
        try:
            self.rollout.shutdown()
        finally:
            self._stop_nodes()


def run_once(engine: Rollout, input_ids, params) -> tuple[float, dict]:
    expected = sum(p["max_new_tokens"] for p in params)
    assert engine.flush_cache()
    before = engine.stats()
    t = time.perf_counter()
    outs = engine.generate(input_ids=input_ids, sampling_params=params, return_logprob=True,
                           return_routed_experts=True)
    dt = time.perf_counter() - t
    after = engine.stats()
    assert sum(len(o.output_ids) for o in outs) == expected
    assert all(o.routed_experts is not None for o in outs)
    # NOTE: under DP each rank counts its own non-empty forwards
    forwards = {k[len("forwards_"):]: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("forwards_")}
    return dt, {k: v for k, v in forwards.items() if v}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=DEFAULT_MODEL_PATH)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--min-new", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dp-sizes", default=None, help="comma-separated (default: 1,2; with --nnodes N: N)")
    ap.add_argument("--nnodes", type=int, default=1,
                    help="also run each configuration as one server across this many nodes (loopback)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.nnodes < 1:
        ap.error(f"--nnodes must be an integer >= 1, got {args.nnodes}")
    dp_sizes = [int(d) for d in (args.dp_sizes or ("1,2" if args.nnodes == 1 else str(args.nnodes))).split(",")]
    bad = [d for d in dp_sizes if d % args.nnodes]
    if bad:
        ap.error(f"--dp-sizes must be multiples of --nnodes={args.nnodes} (dp_size counts every node's ranks), "
                 f"got {bad}")
    with Rollout(args.model_path) as probe:
        vocab = probe.info.vocab_size
    input_ids, params = workload(args.prompts, args.n, args.min_new, args.max_new, vocab)
    total = sum(p["max_new_tokens"] for p in params)
    print(f"workload: {args.prompts} prompts x n={args.n}, {args.min_new}-{args.max_new} new tokens, "
          f"{total} output tokens; capture on; torch {torch.__version__}, {os.cpu_count()} CPUs")
    node_counts = (1, args.nnodes) if args.nnodes > 1 else (1,)
    configs = [(dp, static, nodes) for dp in dp_sizes for static in (False, True) for nodes in node_counts]
    # NOTE: one engine alive at a time, started fresh for every run (startup is timed apart).
    # Each engine thread has its own OpenMP pool, and libgomp throttles every pool once more
    # OpenMP threads exist than CPUs, so engines alive side by side would slow each other.
    # Runs still interleave across configurations, so drifting load hits all alike.
    times: dict = {c: [] for c in configs}
    startups: dict = {c: [] for c in configs}
    forwards: dict = {}
    expert_bytes: dict = {}
    for _ in range(args.repeats):
        for c in configs:
            dp, static, nodes = c
            engine = Engine(args.model_path, dp, static, nodes)
            try:
                rollout = engine.rollout
                rollout.generate(input_ids=input_ids[:4], sampling_params=params[:4], return_routed_experts=True)
                expert_bytes[c] = max(ld["expert_weight_bytes"] for ld in rollout.loads())
                dt, forwards[c] = run_once(rollout, input_ids, params)
            finally:
                engine.shutdown()
            times[c].append(dt)
            startups[c].append(engine.startup_s)
    results = []
    for c in configs:
        dp, static, nodes = c
        dt = statistics.median(times[c])
        results.append({"dp_size": dp, "nnodes": nodes, "runner": "static" if static else "eager", "tok_s": total / dt,
                        "seconds": dt, "runs_s": times[c], "runner_forwards": forwards[c],
                        "startup_s": statistics.median(startups[c]), "output_tokens": total,
                        "expert_bytes_per_rank": expert_bytes[c]})
    base = results[0]
    ref = f"dp={base['dp_size']} eager" + (" 1 node" if args.nnodes > 1 else "")
    print(f"\n| dp_size | nodes | runner | output tok/s | vs {ref} | vs 1 node | forwards by runner (all ranks) "
          f"| startup s | expert weights per rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    one_node = {(r["dp_size"], r["runner"]): r["tok_s"] for r in results if r["nnodes"] == 1}
    for r in results:
        mix = ", ".join(f"{k} {v}" for k, v in sorted(r["runner_forwards"].items()))
        print(f"| {r['dp_size']} | {r['nnodes']} | {r['runner']} | {r['tok_s']:.0f} | {r['tok_s'] / base['tok_s']:.2f}x "
              f"| {r['tok_s'] / one_node[(r['dp_size'], r['runner'])]:.2f}x | {mix} | {r['startup_s']:.1f} "
              f"| {r['expert_bytes_per_rank'] / 2**20:.2f} MiB |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": {"prompts": args.prompts, "n": args.n, "min_new": args.min_new,
                                    "max_new": args.max_new, "output_tokens": total}, "nnodes": args.nnodes,
                       "torch": torch.__version__, "cpus": os.cpu_count(), "results": results}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
