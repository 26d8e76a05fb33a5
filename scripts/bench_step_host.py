"""Host time of one decode step (batch 64), the model's forward excluded, for one or more source trees.

    python scripts/bench_step_host.py [--tree main=/path/to/checkout] [--tree this=.] [--rounds 5] [--json PATH]
        [--attention-backend triton]   # Triton attention, run by the Triton interpreter on CPU (TRITON_INTERPRET=1)

Each tree runs in its own subprocess (PYTHONPATH = that tree), rounds alternating between trees,
so the ratio is measured side by side in one run. A worker builds an EngineCore on the embedded
tiny MoE model (CPU, fp32, --attention-backend: torch by default, or triton, whose kernels the
Triton interpreter runs on CPU; routed-expert capture on), prefills --batch requests,
then times --steps decode steps: `step` is EngineCore.step's wall time, `forward` the time spent
inside the model's forward (a wrapper around it), `host` = step - forward: scheduling, the
ForwardBatch, copies, sampling and the capture commit and output processing. Per run the median
step and the fastest step are kept (the fastest is the steadier figure on a shared host); the
table shows the median over runs of each. Only the public EngineCore / EngineConfig / Req API is
used, so any tree with those runs.
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


def worker(batch: int, steps: int, warmup: int, decode_graphs: bool, attention_backend: str = "torch") -> dict:
    import torch

    from rollout.config import DEFAULT_MODEL_PATH, EngineConfig
    from rollout.core.engine_core import EngineCore
    from rollout.core.request import Req
    from rollout.sampling_params import SamplingParams

    torch.set_num_threads(1)
    cfg = EngineConfig(model_path=DEFAULT_MODEL_PATH, dtype="float32", device="cpu",
                       attention_backend=attention_backend,
                       max_running_requests=batch, enable_return_routed_experts=True,
                       decode_graph_batch_sizes=(batch,) if decode_graphs else ())
    core = EngineCore(cfg)
    forward_s = [0.0]
    inner = core.model.forward

    def timed_forward(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            forward_s[0] += time.perf_counter() - t

    core.model.forward = timed_forward
    rng = random.Random(0)
    total = warmup + steps + 4
    for i in range(batch):
        core.add_request(Req(uid=i + 1, rid=f"r{i}", prompt_ids=[rng.randrange(3, 256) for _ in range(16)],
                             params=SamplingParams(temperature=1.0, max_new_tokens=total, ignore_eos=True),
                             seed=i, return_logprob=True, return_routed_experts=True, max_total_len=16 + total))
    while any(r.kv_len < len(r.prompt_ids) for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
        core.take_updates()
    host, fwd = [], []
    for i in range(warmup + steps):
        assert len(core.scheduler.running) == batch and not core.scheduler.waiting
        forward_s[0] = 0.0
        t = time.perf_counter()
        core.step()
        wall = time.perf_counter() - t
        core.take_updates()
        if i >= warmup:
            host.append(wall - forward_s[0])
            fwd.append(forward_s[0])
    return {"host_ms": statistics.median(host) * 1e3, "forward_ms": statistics.median(fwd) * 1e3,
            "host_ms_min": min(host) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH of a source tree (default: this=.)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-graphs", action="store_true", help="through the decode graph runner (static buffers)")
    ap.add_argument("--attention-backend", default="torch", choices=("torch", "triton"),
                    help="triton: its kernels under the Triton interpreter (their time is inside forward, excluded)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.batch, args.steps, args.warmup, args.decode_graphs, args.attention_backend)))
        return 0
    trees = [t.split("=", 1) for t in (args.tree or [f"this={REPO}"])]
    results: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for _ in range(args.rounds):
        for name, path in trees:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(path), HF_HUB_OFFLINE="1")
            if args.attention_backend == "triton":
                env["TRITON_INTERPRET"] = "1"
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--batch", str(args.batch),
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--attention-backend", args.attention_backend]
            if args.decode_graphs:
                cmd.append("--decode-graphs")
            out = subprocess.run(cmd, env=env, cwd=os.path.abspath(path), capture_output=True, text=True, check=True)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    base = None
    for name, _ in trees:
        host = statistics.median(r["host_ms"] for r in results[name])
        low = statistics.median(r["host_ms_min"] for r in results[name])
        fwd = statistics.median(r["forward_ms"] for r in results[name])
        base = (host, low) if base is None else base
        rows.append({"tree": name, "batch": args.batch, "host_ms_per_step": round(host, 3),
                     "host_ms_fastest_step": round(low, 3), "forward_ms_per_step": round(fwd, 3),
                     "host_vs_first": round(host / base[0], 3), "fastest_vs_first": round(low / base[1], 3)})
    print(f"{'tree':<10} {'batch':>5} {'host ms/step':>13} {'fastest step':>13} {'forward ms/step':>16} "
          f"{'host vs first':>14} {'fastest vs first':>17}")
    for r in rows:
        print(f"{r['tree']:<10} {r['batch']:>5} {r['host_ms_per_step']:>13.3f} {r['host_ms_fastest_step']:>13.3f} "
              f"{r['forward_ms_per_step']:>16.3f} {r['host_vs_first']:>14.3f} {r['fastest_vs_first']:>17.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "runs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
