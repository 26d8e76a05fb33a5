"""Rollout.generate throughput of this checkout against another commit, side by side.

"No lower than before" cannot be read off tables measured on other days: these shared machines
have phases several times slower than others. This script checks the other commit out into a
temporary git worktree and alternates fresh-process runs of bench_throughput's workload (capture
off, the default engine settings) from the two trees, so that both see the same background load;
it prints the medians and the per-repeat ratios, and --json writes them.

The other commit's scripts/bench_throughput.py must have `worker(kind, model_path, prompts, n)`
(every commit since b42a3ff). Example:
  .venv/bin/python scripts/bench_against.py --commit 35146c0 --repeats 6
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(HERE, "scripts"))

from bench_throughput import in_fresh_process  # noqa: E402


def run_tree(tree: str, kind: str, prompts: int, n: int) -> float:
    """Output tok/s of one fresh-process run of `tree`'s engine (its own code and checkpoint)."""
    dt, tokens = in_fresh_process(kind, os.path.join(tree, "configs", "tiny-moe"), prompts, n, tree=tree)
    return tokens / dt


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commit", required=True, help="the commit to compare against (any git revision)")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--kind", default="engine", help="bench_throughput worker kind (default: engine, capture off)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    sha = subprocess.run(["git", "rev-parse", "--short", args.commit], cwd=HERE, check=True, capture_output=True,
                         text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, check=True, capture_output=True,
                          text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="bench_against_") as tmp:
        other = os.path.join(tmp, sha)
        subprocess.run(["git", "worktree", "add", "--detach", other, sha], cwd=HERE, check=True, capture_output=True)
        try:
            runs: dict[str, list[float]] = {head: [], sha: []}
            for r in range(args.repeats):
                for name, tree in ((head, HERE), (sha, other)):
                    runs[name].append(run_tree(tree, args.kind, args.prompts, args.n))
                    print(f"repeat {r}: {name} {runs[name][-1]:.0f} tok/s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", other], cwd=HERE, check=False,
                           capture_output=True)
    med = {name: statistics.median(v) for name, v in runs.items()}
    per = [a / b for a, b in zip(runs[head], runs[sha])]
    print(f"\n| tree | output tok/s (median of {args.repeats}) | per repeat |\n|---|---|---|")
    for name, v in runs.items():
        print(f"| {name}{' (this checkout)' if name == head else ''} | {med[name]:.0f} | "
              f"{', '.join(f'{x:.0f}' for x in v)} |")
    print(f"\n{head} / {sha}: {med[head] / med[sha]:.3f} (medians); per repeat "
          f"{', '.join(f'{x:.2f}' for x in per)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"head": head, "other": sha, "kind": args.kind, "runs_tok_s": runs, "median_tok_s": med,
                       "ratio": med[head] / med[sha], "ratio_per_repeat": per}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
