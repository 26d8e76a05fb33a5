"""DP attention and static-shape runner benchmark on an RL-shaped workload (capture on).

Workload: P prompts of 32-128 tokens, n samples each, per-sample max_new_tokens drawn from
[min_new, max_new], ignore_eos, return_logprob and return_routed_experts. Each configuration
(dp_size x runner: eager only, or static-shape runners with eager for what no bucket fits) runs the
same requests `repeats` times, interleaved across configurations, each run on a freshly started
engine (one alive at a time); it reports output tokens/s of the median run, the forwards each
runner executed and the expert weights each rank holds.

  python scripts/bench_dp.py                      # dp 1 and 2, eager and static runners
  python scripts/bench_dp.py --dp-sizes 1 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout import Rollout  # noqa: E402
from rollout.config import DEFAULT_MODEL_PATH  # noqa: E402

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


def start_engine(model_path: str, dp_size: int, static: bool) -> tuple[Rollout, float]:
    kw = dict(STATIC) if static else {}
    t0 = time.perf_counter()
    engine = Rollout(model_path, enable_return_routed_experts=True, dp_size=dp_size, chunked_prefill_size=512,
                     max_running_requests=128, max_total_tokens=32768, **kw)
    return engine, time.perf_counter() - t0


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
    ap.add_argument("--dp-sizes", default="1,2")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    with Rollout(args.model_path) as probe:
        vocab = probe.info.vocab_size
    input_ids, params = workload(args.prompts, args.n, args.min_new, args.max_new, vocab)
    total = sum(p["max_new_tokens"] for p in params)
    print(f"workload: {args.prompts} prompts x n={args.n}, {args.min_new}-{args.max_new} new tokens, "
          f"{total} output tokens; capture on; torch {torch.__version__}, {os.cpu_count()} CPUs")
    configs = [(int(dp), static) for dp in args.dp_sizes.split(",") for static in (False, True)]
    # NOTE: one engine alive at a time, started fresh for every run (startup is timed apart).
    # Each engine thread has its own OpenMP pool, and libgomp throttles every pool once more
    # OpenMP threads exist than CPUs, so engines alive side by side would slow each other.
    # Runs still interleave across configurations, so drifting load hits all alike.
    times: dict = {c: [] for c in configs}
    startups: dict = {c: [] for c in configs}
    forwards: dict = {}
    expert_bytes: dict = {}
    for _ in range(args.repeats):
        for dp, static in configs:
            engine, startup = start_engine(args.model_path, dp, static)
            try:
                engine.generate(input_ids=input_ids[:4], sampling_params=params[:4], return_routed_experts=True)
                expert_bytes[(dp, static)] = max(ld["expert_weight_bytes"] for ld in engine.loads())
                dt, forwards[(dp, static)] = run_once(engine, input_ids, params)
            finally:
                engine.shutdown()
            times[(dp, static)].append(dt)
            startups[(dp, static)].append(startup)
    results = []
    for dp, static in configs:
        dt = statistics.median(times[(dp, static)])
        results.append({"dp_size": dp, "runner": "static" if static else "eager", "tok_s": total / dt, "seconds": dt,
                        "runs_s": times[(dp, static)], "runner_forwards": forwards[(dp, static)],
                        "startup_s": statistics.median(startups[(dp, static)]), "output_tokens": total,
                        "expert_bytes_per_rank": expert_bytes[(dp, static)]})
    base = results[0]["tok_s"]
    print("\n| dp_size | runner | output tok/s | vs dp=1 eager | forwards by runner (all ranks) | startup s "
          "| expert weights per rank |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        mix = ", ".join(f"{k} {v}" for k, v in sorted(r["runner_forwards"].items()))
        print(f"| {r['dp_size']} | {r['runner']} | {r['tok_s']:.0f} | {r['tok_s'] / base:.2f}x | {mix} | "
              f"{r['startup_s']:.1f} | {r['expert_bytes_per_rank'] / 2**20:.2f} MiB |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": {"prompts": args.prompts, "n": args.n, "min_new": args.min_new,
                                    "max_new": args.max_new, "output_tokens": total},
                       "torch": torch.__version__, "cpus": os.cpu_count(), "results": results}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
