"""Deterministic vs default engine throughput on bench_throughput's workload (prints a table;
--json writes the numbers). Each run is a fresh engine process; the two modes alternate."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_throughput import run_engine, workload  # noqa: E402
from rollout import Rollout  # noqa: E402
from rollout.config import DEFAULT_MODEL_PATH  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-path", default=DEFAULT_MODEL_PATH)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    from transformers import AutoConfig

    prompts, max_news = workload(args.prompts, args.n, AutoConfig.from_pretrained(args.model_path).vocab_size)
    rates: dict[str, list[float]] = {"default": [], "deterministic": []}
    for _ in range(args.repeats):
        for mode in rates:
            with Rollout(args.model_path, enable_return_routed_experts=True,
                         enable_deterministic_inference=mode == "deterministic") as engine:
                dt, tokens = run_engine(engine, prompts, max_news, capture=True)
            rates[mode].append(tokens / dt)
            print(f"run {mode}: {tokens} tokens in {dt:.1f} s", flush=True)
    med = {mode: statistics.median(r) for mode, r in rates.items()}
    print(f"{'mode':<15}{'tok/s (median)':>16}  runs")
    for mode, r in rates.items():
        print(f"{mode:<15}{med[mode]:>16.1f}  " + " ".join(f"{x:.1f}" for x in r))
    ratio = med["deterministic"] / med["default"]
    print(f"deterministic / default: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tok_per_s": rates, "median": med, "ratio": ratio}, f, indent=2)


if __name__ == "__main__":
    main()
