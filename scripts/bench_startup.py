#!/usr/bin/env python
"""Startup: from a fresh Python process to the first result, for one or more source trees side by side.

    python scripts/bench_startup.py [--tree base=/path/to/old/checkout] [--tree this=.] [--rounds 5] [--json PATH]

api: `from rollout import Rollout` (import), `Rollout(model_path)` until it returns (the engine
process started and its model loaded: ready), then one generate of 8 tokens (first result).
server: `python -m rollout.server --port 0` until it prints that it listens (ready), then one
POST /generate of 8 tokens (first result). Times are seconds from the process's launch. Each
measurement is a fresh process tree with that tree's code (cwd and PYTHONPATH), rounds alternating
between trees; medians over rounds. CPU only, the embedded model by default.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

from bench_host_paths import print_side_by_side  # noqa: E402
from rollout.config import DEFAULT_MODEL_PATH  # noqa: E402

PROMPT = [5, 17, 42, 99, 7, 3, 11, 64]
API_CODE = r"""
import json, sys, time
t0 = float(sys.argv[2])
from rollout import Rollout
t_import = time.time()
engine = Rollout(sys.argv[1])
t_ready = time.time()
out = engine.generate(input_ids=[%r], sampling_params={"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True})
t_first = time.time()
assert len(out[0].output_ids) == 8, out
engine.shutdown()
print(json.dumps({"import": t_import - t0, "ready": t_ready - t0, "first_result": t_first - t0}))
""" % (PROMPT,)


def _env(tree: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    return env


def api_startup(tree: str, model_path: str) -> dict:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", API_CODE, model_path, repr(t0)], cwd=tree, env=_env(tree),
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: the api run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def server_startup(tree: str, model_path: str) -> dict:
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "rollout.server", "--host", "127.0.0.1", "--port", "0",
                             "--model-path", model_path, "--log-level", "warning"], cwd=tree, env=_env(tree),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = None
        for line in proc.stdout:
            if "listening on " in line:
                url = line.split("listening on ", 1)[1].strip()
                break
        if url is None:
            raise RuntimeError(f"{tree}: rollout-serve exited with {proc.wait()} before it listened")
        t_ready = time.time()
        body = json.dumps({"input_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 8,
                                                                     "ignore_eos": True}}).encode()
        req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            answer = json.loads(resp.read())
        t_first = time.time()
        assert len(answer["output_ids"]) == 8, answer
        return {"ready": t_ready - t0, "first_result": t_first - t0}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH of a source tree (default: this=.)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model-path", default=DEFAULT_MODEL_PATH)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    trees = [t.split("=", 1) for t in (args.tree or [f"this={REPO}"])]
    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for r in range(args.rounds):
        for name, path in (trees if r % 2 == 0 else trees[::-1]):
            path = os.path.abspath(path)
            run = {f"api {k}": v for k, v in api_startup(path, args.model_path).items()}
            run |= {f"server {k}": v for k, v in server_startup(path, args.model_path).items()}
            runs[name].append(run)
            print(name, {k: round(v, 2) for k, v in run.items()}, flush=True)
    print()
    table = print_side_by_side(runs, [name for name, _ in trees], f"seconds from launch (median of {args.rounds})",
                               "{}", "{:.2f}", "{:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trees": dict(trees), "rounds": args.rounds, "runs": runs, "medians": table}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
