"""This checkout against another commit, side by side: throughput, server throughput, or outputs.

"No lower than before" cannot be read off tables measured on other days: these shared machines
have phases several times slower than others. This script checks the other commit out into a
temporary git worktree and alternates fresh-process runs from the two trees, so that both see the
same background load; it prints the medians and the per-repeat ratios, and --json writes them.

- `--bench throughput` (default): bench_throughput's workload through Rollout.generate (capture
  off, the default engine settings). The other commit's scripts/bench_throughput.py must have
  `worker(kind, model_path, prompts, n)` (every commit since b42a3ff).
- `--bench server`: bench_server's GRPO batch (24 prompts x 8 samples, logprobs and routing on,
  one concurrent non-streaming /generate per sample, as slime sends it) against a fresh
  rollout-serve of each tree; this checkout's load generator for both.
- `--outputs`: no timing. scripts/seeded_outputs.py (this checkout's) runs with each tree's code
  and checkpoint and the two sets of tokens, logprobs (as exact floats) and routing rows (hashed)
  must be identical; exits 1 and prints the first differences otherwise. With --engine-kw this
  checkout's Python workloads run with those engine settings: against --commit HEAD, the same code
  with and without them (the overlap schedule, torch.compile). torch.compile is not bitwise:
  --float-tol lets floats (logprobs) differ by that much and still requires all else identical.

  .venv/bin/python scripts/bench_against.py --commit 35146c0 --repeats 6
  .venv/bin/python scripts/bench_against.py --commit 35146c0 --bench server --repeats 4
  .venv/bin/python scripts/bench_against.py --commit 35146c0 --outputs
  .venv/bin/python scripts/bench_against.py --commit HEAD --outputs --workloads python python_chunked \
      --engine-kw '{"enable_overlap_schedule": true}'
  .venv/bin/python scripts/bench_against.py --commit HEAD --outputs --workloads python python_chunked \
      --engine-kw '{"enable_torch_compile": true, "enable_overlap_schedule": true}' --float-tol 1e-4
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

from bench_throughput import in_fresh_process, rotated  # noqa: E402


def run_tree(tree: str, kind: str, prompts: int, n: int) -> float:
    """Output tok/s of one fresh-process run of `tree`'s engine (its own code and checkpoint)."""
    dt, tokens = in_fresh_process(kind, os.path.join(tree, "configs", "tiny-moe"), prompts, n, tree=tree)
    return tokens / dt


def run_server_tree(tree: str, seed: int) -> float:
    """Output tok/s of bench_server's GRPO batch against a fresh rollout-serve of `tree`."""
    import asyncio  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from bench_server import HttpClient, Server, grpo_batch, grpo_server  # noqa: PLC0415

    server = Server(["--enable-return-routed-experts", "--model-path", os.path.join(tree, "configs", "tiny-moe")],
                    tree=Path(tree))
    try:
        async def run() -> tuple[float, int]:
            async with HttpClient("aiohttp", server.url, 24 * 8) as http:
                await http.warm()
                await grpo_server(http, grpo_batch(seed + 99, prompts=2, samples=2), 2)
                return await grpo_server(http, grpo_batch(seed), 8)

        wall, tokens = asyncio.run(run())
    finally:
        server.stop()
    return tokens / wall


def seeded_outputs(tree: str, out: str, workloads: list[str], engine_kw: str = "{}") -> dict:
    env = dict(os.environ, PYTHONPATH=tree, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="2")
    subprocess.run([sys.executable, os.path.join(HERE, "scripts", "seeded_outputs.py"), "--out", out,
                    "--workloads", *workloads, "--engine-kw", engine_kw], cwd=tree, env=env, check=True)
    with open(out) as f:
        return json.load(f)["outputs"]


def _hex_float(value) -> float | None:
    """A float that seeded_outputs wrote as its exact hex (None for anything else, text included)."""
    if not isinstance(value, str) or not value.lstrip("-").startswith("0x"):
        return None
    try:
        return float.fromhex(value)
    except ValueError:
        return None


def differences(a, b, path: str = "", tol: float = 0.0, worst: list | None = None) -> list[str]:
    """Where a and b differ; with tol > 0 two floats differ only past tol (worst[0]: the largest gap within it)."""
    if tol > 0 and _hex_float(a) is not None and _hex_float(b) is not None:
        gap = abs(_hex_float(a) - _hex_float(b))
        if gap <= tol:
            if worst is not None:
                worst[0] = max(worst[0], gap)
            return []
        return [f"{path}: {_hex_float(a)!r} vs {_hex_float(b)!r} (|d| {gap:.3g} > {tol:g})"]
    if type(a) is not type(b):
        return [f"{path}: {a!r:.80} vs {b!r:.80}"]
    if isinstance(a, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in (differences(a.get(k), b.get(k), f"{path}.{k}", tol, worst) if k in a and k in b
                                          else [f"{path}.{k}: only in {'this checkout' if k in a else 'the other'}"])]
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]", tol, worst)]
    return [] if a == b else [f"{path}: {a!r:.80} vs {b!r:.80}"]


def compare_outputs(head: str, sha: str, other: str, workloads: list[str], engine_kw: str, tol: float = 0.0) -> int:
    with tempfile.TemporaryDirectory(prefix="bench_against_outputs_") as tmp:
        mine = seeded_outputs(HERE, os.path.join(tmp, "head.json"), workloads, engine_kw)
        theirs = seeded_outputs(other, os.path.join(tmp, "other.json"), workloads)
    if engine_kw != "{}":
        head = f"{head} with {engine_kw}"
    worst = [0.0]
    diffs = differences(mine, theirs, tol=tol, worst=worst)
    counts = {name: len(outs) for name, outs in mine.items()}
    if diffs:
        print(f"{head} vs {sha}: {len(diffs)} differences in {counts} outputs; the first:")
        print("\n".join(diffs[:20]))
        return 1
    if tol > 0:
        print(f"{head} vs {sha}: identical but for floats within {tol:g} (largest gap {worst[0]:.3g}; {counts} "
              f"outputs: tokens, text, logprobs, routing rows)")
    else:
        print(f"{head} vs {sha}: identical ({counts} outputs: tokens, text, exact logprobs, routing rows)")
    return 0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commit", required=True, help="the commit to compare against (any git revision)")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--bench", choices=("throughput", "server"), default="throughput")
    ap.add_argument("--outputs", action="store_true", help="compare seeded outputs instead of timing")
    ap.add_argument("--workloads", nargs="+", default=["python", "python_chunked", "server", "archs"],
                    help="--outputs: scripts/seeded_outputs.py's workloads")
    ap.add_argument("--engine-kw", default="{}", metavar="JSON",
                    help="--outputs: engine settings of this checkout's Python workloads (e.g. --commit HEAD "
                         "--engine-kw '{\"enable_overlap_schedule\": true}': this code with and without them)")
    ap.add_argument("--float-tol", type=float, default=0.0,
                    help="--outputs: floats (logprobs) may differ by up to this much, everything else must be "
                         "identical (torch.compile, which is not bitwise: 1e-4)")
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
            if args.outputs:
                sys.exit(compare_outputs(head, sha, other, args.workloads, args.engine_kw, args.float_tol))
            runs: dict[str, list[float]] = {head: [], sha: []}
            for r in range(args.repeats):
                for name, tree in rotated([(head, HERE), (sha, other)], r):
                    runs[name].append(run_tree(tree, args.kind, args.prompts, args.n) if args.bench == "throughput"
                                      else run_server_tree(tree, seed=r))
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
            json.dump({"head": head, "other": sha, "bench": args.bench, "kind": args.kind, "runs_tok_s": runs, "median_tok_s": med,
                       "ratio": med[head] / med[sha], "ratio_per_repeat": per}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
