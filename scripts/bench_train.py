#!/usr/bin/env python
"""Trainer-side benchmark of the GRPO loop on the embedded model (CPU).

1. Training step time with router replay vs without: the same real rollouts (2 bf16 rollout
   servers), one ``PolicyTrainer.train_step`` (DeepSpeed, ZeRO from the config) per measurement,
   modes interleaved (A B C A B C ...) so machine load hits all alike; median and min reported.
   ``plain``: no hooks at all (live routing); ``replay``: RouterReplay replaying the rollout's
   experts; ``replay+metrics``: replay plus the loop's routing measurements (used/live experts).
2. Bytes per sample on the wire (request and response, routing share), for the compact and the
   int32 (SGLang) routing formats, streaming and not.
3. End-to-end loop time split into rollout, train and sync, per weight-sync mode (tensor, disk,
   distributed), over the same two servers.

    python scripts/bench_train.py [--reps 9] [--loop-steps 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402

from trainer_bridge.client import RolloutClient  # noqa: E402
from trainer_bridge.launch import LocalServers  # noqa: E402
from trainer_bridge.losses import grpo_advantages  # noqa: E402
from trainer_bridge.task import ArithmeticTask, arithmetic_reward  # noqa: E402
from trainer_bridge.train import PolicyTrainer, _server_flags, run_async  # noqa: E402
from trainer_bridge.train_config import load_train_config  # noqa: E402


def _rollouts(urls, prompts, n, **client_kw):
    async def go():
        async with RolloutClient(urls, **client_kw) as c:
            return await c.generate_groups(prompts, n, {"temperature": 1.0, "max_new_tokens": 8}, seed=0,
                                           metas=[{"record": r} for r in records])
    return asyncio.run(go())


def bench_step(cfg, samples, reps: int) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model_path)
    for s in samples:
        s.reward = arithmetic_reward(tok.decode(s.response_ids.tolist(), skip_special_tokens=True), s.meta["record"])
    adv = grpo_advantages([s.reward for s in samples], [s.group_id for s in samples])
    trainer = PolicyTrainer(cfg, eos_id=tok.eos_token_id)
    modes = {"plain": dict(replay=False, record_routing=False), "replay": dict(replay=True, record_routing=False),
             "replay+metrics": dict(replay=True, record_routing=True)}
    times = {m: [] for m in modes}
    for m, kw in modes.items():  # warm-up
        trainer.train_step(samples, adv, compare_no_replay=False, **kw)
    names = list(modes)
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for m in order:
            t0 = time.perf_counter()
            trainer.train_step(samples, adv, compare_no_replay=False, **modes[m])
            times[m].append(time.perf_counter() - t0)
    out = {m: {"median_s": statistics.median(v), "min_s": min(v), "all_s": v} for m, v in times.items()}
    for m in ("replay", "replay+metrics"):
        out[m]["overhead_median_pct"] = 100 * (out[m]["median_s"] / out["plain"]["median_s"] - 1)
        out[m]["overhead_min_pct"] = 100 * (out[m]["min_s"] / out["plain"]["min_s"] - 1)
    out["tokens_per_step"] = sum(s.num_tokens for s in samples)
    out["samples_per_step"] = len(samples)
    return out


def bench_bytes(urls, prompts, n) -> dict:
    out = {}
    for fmt in ("compact", "int32"):
        for stream in (False, True):
            async def go():
                async with RolloutClient(urls, routing_format=fmt, stream=stream) as c:
                    before = {u: (d["bytes_in"], d["bytes_out"]) for u, d in c.loads().items()}
                    ss = await c.generate_groups(prompts, n, {"temperature": 1.0, "max_new_tokens": 8}, seed=1,
                                                 metas=[{"record": r} for r in records])
                    after = c.loads()
                    b_in = sum(after[u]["bytes_in"] - before[u][0] for u in after)
                    b_out = sum(after[u]["bytes_out"] - before[u][1] for u in after)
                    return ss, b_in, b_out
            ss, b_in, b_out = asyncio.run(go())
            key = f"{fmt}{'+stream' if stream else ''}"
            routing = [s.meta["routing_bytes"] for s in ss]
            out[key] = {"response_bytes_per_sample": b_in / len(ss), "request_bytes_per_sample": b_out / len(ss),
                        "routing_bytes_per_sample": (sum(routing) / len(ss)) if any(routing) else None,
                        "tokens_per_sample": sum(s.num_tokens for s in ss) / len(ss)}
    return out


def bench_loop(cfg, servers, steps: int) -> dict:
    out = {}
    for mode in ("tensor", "disk", "distributed"):
        c = load_train_config(None, [], **{**{k: getattr(cfg, k) for k in ("model_path", "run_dir", "server_dtype",
                                                                           "prompts_per_step", "samples_per_prompt",
                                                                           "max_new_tokens", "lr", "zero_stage")},
                                           "steps": steps, "weight_sync": mode, "num_eval_prompts": 0,
                                           "compare_no_replay": False, "progress": False,
                                           "wandb_mode": "disabled"})
        t0 = time.perf_counter()
        res = asyncio.run(run_async(c, servers=servers, log=lambda *_: None))
        wall = time.perf_counter() - t0
        hist = res.history
        row = {k: sum(h[k] for h in hist) / len(hist) for k in ("rollout_s", "train_s", "sync_s")}
        row["step_s"] = sum(row.values())
        row["sync_bytes"] = hist[-1]["sync_bytes"]
        row["wall_s"] = wall
        row["share_pct"] = {k: 100 * row[k] / row["step_s"] for k in ("rollout_s", "train_s", "sync_s")}
        out[mode] = row
    return out


records: list = []


def main() -> int:
    global records
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "train" / "tiny.yaml"))
    ap.add_argument("--reps", type=int, default=9, help="interleaved train steps per mode")
    ap.add_argument("--loop-steps", type=int, default=4, help="GRPO steps per weight-sync mode")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    run_dir = tempfile.mkdtemp(prefix="bench-train-")
    cfg = load_train_config(args.config, [f"run_dir={run_dir}", "compare_no_replay=false", "progress=false"])
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(cfg.model_path)
    records = ArithmeticTask().examples(cfg.prompts_per_step, seed=123, split="train", unique=True)
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in records]
    results: dict = {"config": args.config, "prompts_per_step": cfg.prompts_per_step,
                     "samples_per_prompt": cfg.samples_per_prompt, "zero_stage": cfg.zero_stage,
                     "torch_threads": torch.get_num_threads(), "server_dtype": cfg.server_dtype}
    Path(cfg.resolved_sync_dir).mkdir(parents=True, exist_ok=True)
    with LocalServers(2, _server_flags(cfg), log_dir=str(Path(run_dir) / "server-logs")) as servers:
        samples = _rollouts(servers.urls, prompts, cfg.samples_per_prompt)
        print(f"rollouts: {len(samples)} samples, {sum(s.num_tokens for s in samples)} tokens", flush=True)
        results["step"] = bench_step(cfg, samples, args.reps)
        results["bytes"] = bench_bytes(servers.urls, prompts[:8], cfg.samples_per_prompt)
        results["loop"] = bench_loop(cfg, servers, args.loop_steps)

    st = results["step"]
    print(f"\n## Training step ({st['samples_per_step']} samples, {st['tokens_per_step']} tokens, "
          f"ZeRO-{cfg.zero_stage}, {args.reps} interleaved reps)")
    print(f"{'mode':16s} {'median s':>9s} {'min s':>8s} {'vs plain (median)':>18s} {'vs plain (min)':>15s}")
    for m in ("plain", "replay", "replay+metrics"):
        r = st[m]
        med = f"{r['overhead_median_pct']:+.1f}%" if "overhead_median_pct" in r else "-"
        mn = f"{r['overhead_min_pct']:+.1f}%" if "overhead_min_pct" in r else "-"
        print(f"{m:16s} {r['median_s']:9.3f} {r['min_s']:8.3f} {med:>18s} {mn:>15s}")
    print("\n## Bytes per sample on the wire")
    print(f"{'format':16s} {'response B':>11s} {'routing B':>10s} {'request B':>10s} {'tokens':>7s}")
    for k, r in results["bytes"].items():
        rb = f"{r['routing_bytes_per_sample']:.0f}" if r["routing_bytes_per_sample"] else "(in chunks)"
        print(f"{k:16s} {r['response_bytes_per_sample']:11.0f} {rb:>10s} {r['request_bytes_per_sample']:10.0f} "
              f"{r['tokens_per_sample']:7.1f}")
    print(f"\n## GRPO loop per step ({args.loop_steps} steps each, {cfg.samples_per_step} samples/step)")
    print(f"{'weight sync':12s} {'rollout s':>10s} {'train s':>8s} {'sync s':>8s} {'step s':>7s} "
          f"{'sync MB':>8s} {'rollout/train/sync %':>22s}")
    for mode, r in results["loop"].items():
        sh = r["share_pct"]
        print(f"{mode:12s} {r['rollout_s']:10.2f} {r['train_s']:8.2f} {r['sync_s']:8.3f} {r['step_s']:7.2f} "
              f"{r['sync_bytes'] / 2**20:8.2f} {sh['rollout_s']:6.1f}/{sh['train_s']:.1f}/{sh['sync_s']:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
